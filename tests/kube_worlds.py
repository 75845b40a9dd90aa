"""Clusters the healing tests build on the loopback fake API server."""

from __future__ import annotations

from tests.fake_apiserver import FakeApiServer


def llama_on_gpu_1(api: FakeApiServer, *, nodes: int = 40, ranks: int = 3) -> None:
    """`nodes` nodes gpu-0.. (enough that the breaker lets two quarantines through) and a PyTorchJob "llama" in
    namespace training with `ranks` Running pods of 2 GPUs each on gpu-1 (as many evictions for its drain)."""
    for i in range(nodes):
        api.add_node(f"gpu-{i}")
    api.install_kind("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
    job = api.add_object("kubeflow.org", "v1", "pytorchjobs", "training", {"metadata": {"name": "llama"}})
    owner = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama",
             "uid": job["metadata"]["uid"], "controller": True}
    for rank in range(ranks):
        api.add_pod("training", f"llama-worker-{rank}", node="gpu-1", phase="Running", owners=[owner],
                    requests={"nvidia.com/gpu": "2"},
                    labels={"training.kubeflow.org/job-name": "llama", "kmend.io/job": "llama"})
