"""Fluent Bit path: the rendered YAML config against the documented schema, and /v1/ingest/fluentbit."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from analyzer.progress_rules import default_progress_rules_dir
from analyzer.rules import Rule
from collector.fluentbit import FluentBitOptions, dump_config, onigmo, render_config
from tests.agent_helpers import TOKEN, Service
from tests.conftest import REPO, free_port

# From Fluent Bit's YAML configuration docs: top-level sections, pipeline sections,
# and the plugin/parser names this config relies on.
TOP_LEVEL = {"service", "pipeline", "parsers", "multiline_parsers", "env", "includes", "customs", "plugins",
             "upstream_servers"}
PIPELINE = {"inputs", "filters", "outputs"}
INPUTS = {"tail", "kmsg", "systemd", "forward", "http", "dummy"}
FILTERS = {"kubernetes", "grep", "record_modifier", "modify", "parser", "lua", "multiline"}
OUTPUTS = {"http", "stdout", "forward"}
BUILTIN_MULTILINE = {"docker", "cri", "go", "python", "java"}
HTTP_FORMATS = {"msgpack", "json", "json_lines", "json_stream", "gelf"}
DATE_FORMATS = {"double", "epoch", "iso8601", "java_sql_timestamp"}


@pytest.fixture(scope="module")
def rendered(shipped_rules: list[Rule]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "kmend.cli", "fluentbit-config", "--service-host", "kmend.ops.svc"],
                         capture_output=True, text=True, check=True, cwd=REPO)
    doc: dict[str, Any] = yaml.safe_load(out.stdout)
    return doc


def _tag_matches(pattern: str, tag: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), tag) is not None


def test_config_follows_fluent_bit_yaml_schema(rendered: dict[str, Any]) -> None:
    assert set(rendered) <= TOP_LEVEL and set(rendered["pipeline"]) <= PIPELINE
    pipe = rendered["pipeline"]
    for section, known in (("inputs", INPUTS), ("filters", FILTERS), ("outputs", OUTPUTS)):
        for plugin in pipe[section]:
            assert plugin["name"] in known
            assert all(isinstance(k, str) and k == k.lower() for k in plugin)
    tail = next(i for i in pipe["inputs"] if i["name"] == "tail")
    assert {p.strip() for p in tail["multiline.parser"].split(",")} <= BUILTIN_MULTILINE
    assert "cri" in tail["multiline.parser"] and tail["db"].startswith("/var/lib/")
    assert any(i["name"] == "kmsg" for i in pipe["inputs"])
    out = pipe["outputs"][0]
    assert out["format"] == "json_lines" and out["format"] in HTTP_FORMATS
    assert out["json_date_format"] in DATE_FORMATS and out["compress"] == "gzip"
    assert out["uri"] == "/v1/ingest/fluentbit" and out["host"] == "kmend.ops.svc"
    assert out["header"] == ["Authorization Bearer ${KMEND_TOKEN}"]
    assert rendered["service"]["storage.path"].startswith("/var/lib/")


def test_every_filter_and_output_matches_an_input_tag(rendered: dict[str, Any]) -> None:
    pipe = rendered["pipeline"]
    tail = next(i for i in pipe["inputs"] if i["name"] == "tail")
    # tail expands "kube.*" with the file path, dots for slashes: what the kubernetes filter expects.
    tags = ["kube.var.log.containers.llama-0_train_trainer-abc.log", "kmsg"]
    assert tail["tag"] == "kube.*"
    kube = next(f for f in pipe["filters"] if f["name"] == "kubernetes")
    assert tags[0].startswith(kube["kube_tag_prefix"])
    for plugin in pipe["filters"] + pipe["outputs"]:
        assert any(_tag_matches(plugin["match"], t) for t in tags), plugin


def test_grep_filters_keep_every_rule_example(rendered: dict[str, Any], shipped_rules: list[Rule]) -> None:
    greps = {f["match"]: f["regex"] for f in rendered["pipeline"]["filters"] if f["name"] == "grep"}
    key_re = {m: (r.split(" ", 1)[0], re.compile(r.split(" ", 1)[1])) for m, r in greps.items()}
    assert key_re["kube.*"][0] == "log" and key_re["kmsg"][0] == "msg"
    for rule in shipped_rules:
        for tag, src in (("kube.*", "container"), ("kmsg", "kernel")):
            if rule.applies_to(src):
                for example in rule.examples:
                    assert key_re[tag][1].search(example), (rule.id, example)
    assert not key_re["kube.*"][1].search("dataloader worker 3 prefetched 64 samples")
    # A plain "epoch E step S" is a trainer's progress: the hang detector needs it shipped.
    assert key_re["kube.*"][1].search("Epoch 3 step 1200 loss 1.873")


def test_grep_filter_keeps_trainers_progress_lines(rendered: dict[str, Any]) -> None:
    [container] = [f["regex"] for f in rendered["pipeline"]["filters"]
                   if f["name"] == "grep" and f["match"] == "kube.*"]
    grep = re.compile(container.split(" ", 1)[1])
    examples = [(rule["id"], ex["line"]) for pack in sorted(default_progress_rules_dir().glob("*.yaml"))
                for rule in yaml.safe_load(pack.read_text())["rules"] for ex in rule["examples"]]
    assert len(examples) > 10
    for rule_id, line in examples:
        assert grep.search(line), (rule_id, line)


def test_onigmo_conversion_drops_python_named_groups() -> None:
    assert onigmo(r"Xid \(PCI:(?P<pci>[0-9a-f:.]+)\): (?P<xid>79),") == r"Xid \(PCI:(?:[0-9a-f:.]+)\): (?:79),"
    doc = render_config(FluentBitOptions(kmsg=False, token_env=None), container_patterns=[], kernel_patterns=[])
    assert [f["name"] for f in doc["pipeline"]["filters"]] == ["kubernetes", "record_modifier"]
    assert "header" not in doc["pipeline"]["outputs"][0]
    assert yaml.safe_load(dump_config(doc)) == doc


# Record shapes as Fluent Bit documents them: tail + cri parser + kubernetes filter, and kmsg.
K8S_RECORD = {
    "date": 1795255201.123456,
    "time": "2026-11-21T10:00:01.123456789Z",
    "stream": "stderr",
    "_p": "F",
    "log": "[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3",
    "kubernetes": {
        "pod_name": "llama-worker-3", "namespace_name": "train",
        "pod_id": "5f1c9a2e-1b7d-4c55-9a0e-0c1d2e3f4a5b",
        "labels": {"training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-index": "3"},
        "host": "gpu-node-07", "container_name": "trainer",
        "docker_id": "3b9d5b0f1c2e", "container_image": "nvcr.io/nvidia/pytorch:24.05-py3",
    },
    "node": "gpu-node-07",
}
KMSG_RECORD = {"date": 1795255200.5, "priority": 4, "sequence": 1202, "sec": 5140, "usec": 900000,
               "msg": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
               "node": "gpu-node-07"}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, free_port())
    svc.start()
    yield svc
    svc.stop()
    svc.kmend.store.close()


def _post(svc: Service, body: bytes, **params: str) -> httpx.Response:
    return httpx.post(f"{svc.url}/v1/ingest/fluentbit", content=gzip.compress(body), params=params,
                      headers={"Content-Encoding": "gzip", "Authorization": f"Bearer {TOKEN}"})


def test_json_lines_payload_becomes_signals_and_findings(service: Service) -> None:
    body = (json.dumps(K8S_RECORD) + "\n" + json.dumps(KMSG_RECORD) + "\n").encode()
    resp = _post(service, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["accepted"] == 2 and resp.json()["findings"] == 2
    log = service.stored("container")[0]
    assert log["node"] == "gpu-node-07"
    assert log["body"]["payload"] == {
        "kind": "log", "text": K8S_RECORD["log"], "namespace": "train", "pod": "llama-worker-3",
        "container": "trainer", "job": "llama", "rank": 3}
    assert service.stored("kernel")[0]["body"]["payload"]["text"].startswith("NVRM: Xid")
    # Fluent Bit retries a failed flush with the same records: nothing is counted twice.
    again = _post(service, body).json()
    assert again["accepted"] == 0 and again["duplicates"] == 2 and again["findings"] == 0


def test_json_array_format_iso_dates_and_default_node(service: Service) -> None:
    rec = {"date": "2026-11-21T10:00:03.000000Z", "log": "CUDA out of memory. Tried to allocate 1.00 GiB",
           "kubernetes": {"pod_name": "p", "namespace_name": "ns", "container_name": "c"}}
    resp = _post(service, json.dumps([rec]).encode(), node="gpu-node-09")
    assert resp.json()["accepted"] == 1
    stored = service.stored("container")[0]
    assert stored["node"] == "gpu-node-09"


def test_malformed_payload_rejected_whole_and_token_required(service: Service) -> None:
    assert _post(service, b'{"log": "a", "node": "n"}\nnot json\n').status_code == 422
    assert service.stored_ids() == []
    plain = httpx.post(f"{service.url}/v1/ingest/fluentbit", content=json.dumps(K8S_RECORD).encode())
    assert plain.status_code == 401
