"""Fault families the packs used to miss, each shown by real development-half excerpts: the
lines go through the `kmend analyze` path and the top incident has the thread's class, call
and an acceptable action."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.corpus import CorpusEntry
from analyzer.rules import default_rules_dir
from kmend.corpus_eval import load_corpus, run_entries

CORPUS = Path(__file__).parent / "corpus"

# One or two development excerpts per family (ids in tests/corpus); held-out ones never
# appear here because rules are not written from them.
FAMILIES = {
    "cuda driver-api spellings": ["jax-25002-xla-illegal-address", "xla-15945-custom-call-illegal-address"],
    "cuda illegal instruction": ["trtllm-11313-illegal-instruction-custom-kernel",
                                 "cutlass-2932-illegal-instruction-715"],
    "cuda unspecified launch failure": ["basicsr-211-unspecified-launch-failure"],
    "cublas not supported": ["deepspeed-6723-cublas-not-supported", "bminf-52-cublaslt-not-supported"],
    "xla and tensorflow gpu oom": ["alphafold-1023-resource-exhausted", "segan-42-oom-tensor-shape"],
    "ggml cudamalloc oom": ["llama-cpp-20431-cudamalloc-144gib-device-0",
                            "llama-cpp-pr26297-cudamalloc-device-1-compute-buffer"],
    "job mistakes that look like hardware": ["torchkeras-20-tensors-nll-loss", "suod-15-erofs-site-packages",
                                             "caduceus-58-emfile-dataloader-pipe",
                                             "powersgd-21-store-barrier-world-size"],
    "nccl system and socket errors": ["nccl-473-error-2-ipc-host", "nccl-tests-14-socket-family-not-supported",
                                      "nccl-1486-socketprogress-closed-by-peer",
                                      "nccl-293-bootstrap-bind-address-in-use"],
    "gpu unusable without an xid": ["pai-4344-rminitadapter-gpu-missing"],
    "node software faults": ["kubernetes-94020-node-status-unknown-json", "gpu-operator-349-kubelet-no-runtime-nvidia",
                             "nvidia-docker-1442-unsatisfied-cuda-11", "shine-cluster-30-nvml-version-mismatch",
                             "cosmic-epoch-3411-open-module-no-gsp"],
    "host oom in slurm": ["arjuna-52-slurm-cgroup-oom-kill"],
    "storage": ["gcs-fuse-csi-50-enotconn-mkdir", "deepracer-core-81-s3-put-clock-skew",
                "longhorn-193-medium-error-remount-ro", "s3fs-2176-unable-to-access-mountpoint-enotconn"],
    "gsp stops answering without an xid": ["ogkm-1230-gsp-heartbeat-sysmembar-timeout"],
    "thc-era cuda runtime error spelling": ["depthawarecnn-12-cuda-runtime-error-77"],
    "socket bootstrap to loopback": ["awsome-192-socket-connect-abort-loopback"],
    "ib port events in every nccl spelling": ["llm-d-191-ib-async-error-event-port-flap",
                                              "gpud-pr482-ibstat-down-polling"],
}
BENIGN = ["kubernetes-43516-ready-again", "hamonikr-13-ext4-remounted-opts", "open-gpu-1098-boot-empty-line",
          "nccl-1231-plugin-dlerror-harmless", "nccl-352-no-plugin-no-ib-device-loopback-socket"]


@pytest.fixture(scope="module")
def by_id() -> dict[str, CorpusEntry]:
    return {e.id: e for e in load_corpus(CORPUS)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_diagnosed_as_its_thread_concluded(by_id: dict[str, CorpusEntry], family: str) -> None:
    entries = [by_id[i] for i in FAMILIES[family]]
    assert all(e.split == "dev" for e in entries)
    for o in run_entries(entries, [default_rules_dir()]):
        e = o.entry
        assert o.fault_class == e.fault_class, (e.id, o.fault_class, o.rule)
        assert e.hardware is None or o.hardware == e.hardware, (e.id, o.hardware, o.rule)
        assert o.action in e.actions, (e.id, o.action, o.rule)
        assert not o.app_quarantine, e.id


def test_look_alikes_stay_silent(by_id: dict[str, CorpusEntry]) -> None:
    entries = [by_id[i] for i in BENIGN]
    assert all(e.benign and e.split == "dev" for e in entries)
    for o in run_entries(entries, [default_rules_dir()]):
        assert o.fault_class is None, (o.entry.id, o.rule)
