"""Which pods run on a node, as the healer asks before a plan: answered from the gang scheduler's pod watch while it
is in sync (no request to the server, and a pod bound or finished a moment ago shows), from a list otherwise."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from healer.kube.pods import KubePodScheduling
from healer.kube.workloads import KubeWorkloads
from tests.fake_apiserver import FakeApiServer

DAEMONSET = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "dcgm", "uid": "u-ds", "controller": True}
JOB = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "llama", "uid": "u-job", "controller": True}


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        for name in ("n1", "n2"):
            server.add_node(name)
        server.add_pod("t", "llama-0", node="n1", phase="Running", owners=[JOB],
                       labels={"training.kubeflow.org/job-name": "llama"})
        server.add_pod("t", "llama-1", node="n2", phase="Running", owners=[JOB],
                       labels={"training.kubeflow.org/job-name": "llama"})
        server.add_pod("kube-system", "dcgm-n1", node="n1", phase="Running", owners=[DAEMONSET])
        server.add_pod("t", "pending", scheduler="kmend")
        yield server


def _ports(api: FakeApiServer) -> tuple[KubePodScheduling, KubeWorkloads]:
    raw = client.ApiClient(client.Configuration(host=api.url))
    kube = KubePodScheduling(raw, clock=time.time)
    workloads = KubeWorkloads(raw)
    workloads.pod_watch = kube.pods_on_node  # as kmend/wiring.py connects them
    return kube, workloads


def _pod_gets(api: FakeApiServer) -> int:
    return sum(1 for method, path in api.requests if method == "GET" and path.endswith("/pods"))


def _until(pred: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout  # generous for a loaded machine; returns as soon as it holds
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def _names(pods: Any) -> list[str]:
    return sorted(p.name for p in pods)


def test_the_pods_on_a_node_come_from_the_watch_without_a_request(api: FakeApiServer) -> None:
    kube, workloads = _ports(api)
    try:
        kube.changes("")  # the scheduler's first cycle: lists once and starts the watch
        gets = _pod_gets(api)
        on_n1 = workloads.pods_on_node("n1")
        assert _names(on_n1) == ["dcgm-n1", "llama-0"]
        assert _pod_gets(api) == gets and workloads.pod_lists == 0  # nothing asked of the server
        # What a decision reads: owners (a DaemonSet's pod is no job's), labels, phase, namespace.
        by_name = {p.name: p for p in on_n1}
        assert by_name["dcgm-n1"].controller is not None and by_name["dcgm-n1"].controller.kind == "DaemonSet"
        assert by_name["llama-0"].labels["training.kubeflow.org/job-name"] == "llama"
        assert by_name["llama-0"].phase == "Running" and by_name["llama-0"].namespace == "t"
        # A pod bound a moment ago shows, one that finished is gone, one bound elsewhere is not here.
        api.add_pod("t", "llama-2", node="n1", phase="Running", owners=[JOB])
        api.set_phase("t", "llama-0", "Succeeded")
        _until(lambda: _names(workloads.pods_on_node("n1")) == ["dcgm-n1", "llama-2"])
        assert _names(workloads.pods_on_node("n2")) == ["llama-1"]
        assert _pod_gets(api) == gets
        # The same answer a list gives.
        assert _names(workloads.pods_on_node("n1")) == _names(workloads.list_pods(node="n1"))
    finally:
        kube.close()


def test_without_a_watch_in_sync_the_pods_are_listed(api: FakeApiServer) -> None:
    kube, workloads = _ports(api)
    # Before the scheduler's first cycle there is no watch yet: a list answers.
    assert _names(workloads.pods_on_node("n1")) == ["dcgm-n1", "llama-0"]
    assert workloads.pod_lists == 1
    kube.changes("")
    workloads.pods_on_node("n1")
    assert workloads.pod_lists == 1
    # Once the watch is stopped (or broken) its store may be stale: a list answers again.
    kube.close()
    api.add_pod("t", "llama-3", node="n1", phase="Running", owners=[JOB])
    assert _names(workloads.pods_on_node("n1")) == ["dcgm-n1", "llama-0", "llama-3"]
    assert workloads.pod_lists == 2


def test_after_an_expired_watch_the_node_view_is_rebuilt_from_the_new_list(api: FakeApiServer) -> None:
    kube, workloads = _ports(api)
    try:
        kube.changes("")
        informer = kube._informer
        assert informer is not None
        api.watch.expire()
        api.add_pod("t", "llama-4", node="n2", phase="Running", owners=[JOB])
        api.set_phase("t", "llama-1", "Failed")
        _until(lambda: informer.lists == 2)
        _until(lambda: _names(workloads.pods_on_node("n2") or ()) == ["llama-4"])
        assert _names(workloads.pods_on_node("n1")) == ["dcgm-n1", "llama-0"]
    finally:
        kube.close()
