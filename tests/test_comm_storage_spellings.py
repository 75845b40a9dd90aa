"""Spellings of communication, storage, GPU-memory and application faults the packs used to miss
(NVSHMEM transports, CUDA peer access, TensorRT and RAPIDS allocations, shape mismatches, DDP's
unused parameters, NCCL in a small /dev/shm, JuiceFS, BeeGFS, gcsfs), each shown by real
development-half excerpts through the `kmend analyze` path, and the look-alikes from the same
threads that must stay silent."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from analyzer.corpus import parse_entries
from analyzer.rules import default_rules_dir
from kmend.corpus_eval import Outcome, run_entries

CORPUS = Path(__file__).parent / "corpus"

# Development excerpts only (ids in tests/corpus/round15b-*.yaml): rules are not written from held-out ones.
FAMILIES = {
    "nvshmem transport set-up": ["deepep-55-nvshmem-ibgda-init-failed-driver-config",
                                 "sglang-12533-nvshmem-ibgda-devx-uar-unprivileged",
                                 "nvshmem-51-no-ibgda-capable-device"],
    "nvshmem queue pairs on roce": ["deepep-38-nvshmem-ibrc-modify-qp-timeout-roce",
                                    "sglang-7888-nvshmem-ibrc-modify-qp-failed-decode",
                                    "mgpm-21-nvshmem-ibv-poll-cq-status-4"],
    "gpus without peer access": ["dynamo-1229-cuda-peer-access-unsupported-vllm",
                                 "llama-cpp-3230-cuda-error-217-peer-access", "deepep-584-peer-access-partial-pcie"],
    "tensorrt allocations": ["tensorrt-inference-155-safe-runtime-allocate-oom",
                             "onnxruntime-10770-trt-ep-allocate-oom", "tensorrt-948-default-allocator-oom-windows",
                             "torch-tensorrt-2836-default-allocator-cuda-runtime-oom"],
    "shapes that do not fit": ["mtpsl-3-mat1-mat2-shapes-cannot-be-multiplied",
                               "megatron-3240-convert-tp4-size-of-tensor-a",
                               "nemo-10715-global-shape-mismatch-position-embeddings"],
    "juicefs backends": ["juicefs-1250-upload-timeout-flush-minio-slow",
                         "juicefs-5963-access-log-write-eio-after-minio-stop",
                         "juicefs-182-redis-bad-state-write-inode-eio", "juicefs-4055-redis-meta-io-timeout-flink"],
    "shared filesystem clients and object stores": ["beegfs-84-client-module-insert-invalid-after-update",
                                                    "gcsfs-189-backend-error-read"],
    "nccl shared memory in a small /dev/shm": ["nccl-342-shm-posix-fallocate-docker-64mb",
                                               "pytorch-ci-infra-490-nccl-shm-extend-failed"],
    "rapids and cupy allocations": ["cudf-10517-rmm-bad-alloc-out-of-memory",
                                    "cudf-6773-rmm-cuda-memory-allocation-two-kernels",
                                    "dask-10202-cupy-out-of-memory-allocating-commas"],
    "ddp parameters outside the loss": ["zsseg-35-ddp-finished-reduction-unused-params",
                                        "yolov3-454-ddp-finished-reduction-torch-1-2"],
}
BENIGN = ["juicefs-1982-cloud-request-timeout-benign", "nccl-258-cuda-gdb-enable-peer-access-warnings-benign",
          "voltaml-15-trt-tactic-oom-warnings-benign"]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    """Every excerpt named here through the shipped packs in one run (only this round's files are read)."""
    entries = [e for f in sorted(CORPUS.glob("round15b-*.yaml"))
               for e in parse_entries(yaml.safe_load(f.read_text(encoding="utf-8")), str(f))]
    wanted = {i for ids in FAMILIES.values() for i in ids} | set(BENIGN)
    return {o.entry.id: o for o in run_entries([e for e in entries if e.id in wanted], [default_rules_dir()])}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_diagnosed_as_its_thread_concluded(outcomes: dict[str, Outcome], family: str) -> None:
    for o in (outcomes[i] for i in FAMILIES[family]):
        e = o.entry
        assert e.split == "dev", e.id
        assert o.fault_class == e.fault_class, (e.id, o.fault_class, o.rule)
        assert e.hardware is None or o.hardware == e.hardware, (e.id, o.hardware, o.rule)
        assert o.action in e.actions, (e.id, o.action, o.rule)
        assert not o.app_quarantine, e.id


def test_look_alikes_stay_silent(outcomes: dict[str, Outcome]) -> None:
    for o in (outcomes[i] for i in BENIGN):
        assert o.entry.benign and o.entry.split == "dev", o.entry.id
        assert o.fault_class is None, (o.entry.id, o.rule)
