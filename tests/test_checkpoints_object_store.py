"""Checkpoint discovery on an object store (S3 through fsspec) against a local S3-compatible server: the newest
complete checkpoint is found, a partial newer one is skipped and named, and the restore step publishes it."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from healer.checkpoint_remote import is_object_store_url, object_store_path
from healer.checkpoints import discover
from healer.workloads import ObjectKey
from tests.healing import Harness, incident

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    # fsspec caches a filesystem per set of options: one made for an earlier test's server must not be reused.
    pytest.importorskip("s3fs").S3FileSystem.clear_instance_cache()
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="ckpts")
    try:
        yield client
    finally:
        server.stop()


def _safetensors(complete: bool) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0" * (16 if complete else 5)


def _put_hf(client: object, prefix: str, *, complete: bool) -> None:
    client.put_object(Bucket="ckpts", Key=f"{prefix}/trainer_state.json",  # type: ignore[attr-defined]
                      Body=json.dumps({"global_step": 1}).encode())
    client.put_object(Bucket="ckpts", Key=f"{prefix}/model.safetensors",  # type: ignore[attr-defined]
                      Body=_safetensors(complete))


def test_object_store_urls_are_recognised() -> None:
    assert is_object_store_url("s3://b/x") and is_object_store_url("gs://b/x") and is_object_store_url("az://c/x")
    assert not is_object_store_url("/mnt/ckpt") and not is_object_store_url("file:///mnt/ckpt")


def test_newest_complete_checkpoint_is_found_on_s3_and_a_partial_one_skipped(s3: object) -> None:
    _put_hf(s3, "run-7/checkpoint-100", complete=True)
    _put_hf(s3, "run-7/checkpoint-200", complete=False)  # the upload was cut short
    found = discover(object_store_path("s3://ckpts/run-7"))
    assert found.latest is not None and found.latest.step == 100
    assert found.latest.path.endswith("ckpts/run-7/checkpoint-100")
    [(path, why)] = found.skipped
    assert path.endswith("checkpoint-200") and "truncated" in why


def test_restore_step_publishes_an_s3_checkpoint(tmp_path: Path, s3: object) -> None:
    from analyzer.rules import default_rules_dir, load_rules
    from tests.builders import XID79, container, kernel

    _put_hf(s3, "llama/checkpoint-40", complete=True)
    h = Harness(tmp_path, job_nodes=4, checkpoint_path="s3://ckpts/llama")
    node = h.workloads.list_pods(namespace="training")[0].node
    inc = incident(load_rules([default_rules_dir()]), [container(node, "step 1", job="llama", rank=0,
                                                                 ts=h.clock()), kernel(node, XID79, ts=h.clock())])
    plan = h.run(h.plan(inc))
    step = next(s for s in plan.steps if s.kind.value == "checkpoint")
    assert step.state.value == "succeeded", step.result
    assert step.outputs["resume_from"].endswith("ckpts/llama/checkpoint-40")
    cm = h.workloads.get_object(ObjectKey("v1", "ConfigMap", "training", "llama-kmend-resume"))
    assert cm is not None and cm["data"]["KMEND_RESUME_STEP"] == "40"
