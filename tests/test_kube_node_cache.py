"""Nodes read from a watch-fed cache (official client, loopback fake API server): the healer's node reads and the
gang scheduler's cycles list the nodes once, not once per call; changes arrive through the watch; an expired watch
(410 Gone) is answered by exactly one list; a kind the server does not serve reads as empty."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from healer.kube.cache import ListWatchCache
from healer.kube.cluster import KubeCluster
from healer.kube.pods import KubePodScheduling
from tests.fake_apiserver import FakeApiServer


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        for i in range(6):
            server.add_node(f"gpu-{i}", {"topology.kmend.io/leaf": f"leaf-{i // 3}"})
        yield server


def _node_lists(api: FakeApiServer) -> int:
    """Node list requests (watches are streamed and counted apart)."""
    return sum(1 for method, path in api.requests if (method, path) == ("GET", "/api/v1/nodes"))


def _until(what: str, pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _client(api: FakeApiServer) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=api.url))


def test_the_healers_node_reads_list_once_and_follow_changes_through_the_watch(api: FakeApiServer) -> None:
    cluster = KubeCluster(_client(api), node_cache=True)
    plain = KubeCluster(_client(api))
    try:
        for _ in range(50):  # fifty healer rounds: the brakes' and the acceptance check's reads
            assert len(cluster.list_nodes()) == 6
            assert [n.name for n in cluster.list_nodes({"topology.kmend.io/leaf": "leaf-1"})] == \
                ["gpu-3", "gpu-4", "gpu-5"]
        assert _node_lists(api) == 1
        plain.cordon("gpu-4")
        plain.patch_node_metadata("gpu-4", labels={"kmend.io/quarantined": "true"})
        _until("the cordon seen", lambda: [n.name for n in cluster.list_nodes({"kmend.io/quarantined": "true"})
                                           if n.unschedulable] == ["gpu-4"])
        api.add_node("gpu-6")
        _until("the new node seen", lambda: any(n.name == "gpu-6" and not n.taints for n in cluster.list_nodes()))
        # etcd compacted the history: one list, and the state is current again.
        api.node_watch.expire()
        plain.uncordon("gpu-4")
        _until("the uncordon seen", lambda: not any(n.unschedulable for n in cluster.list_nodes()))
        # The stream may hand over the uncordon before its 410 (both were pending when it woke): the list follows.
        _until("the list after the expiry", lambda: _node_lists(api) == 2)
        time.sleep(0.3)
        assert _node_lists(api) == 2
        assert not any(n.unschedulable for n in cluster.list_nodes())
    finally:
        cluster.close()


def test_the_gang_schedulers_cycles_list_the_nodes_once(api: FakeApiServer) -> None:
    port = KubePodScheduling(_client(api), clock=time.time, watch_read_timeout_s=1.0)
    plain = KubeCluster(_client(api))
    try:
        cursor = ""
        for _ in range(40):
            got = port.changes(cursor)
            cursor = got.cursor
            assert [n.name for n in got.nodes] == [f"gpu-{i}" for i in range(6)]
        assert _node_lists(api) == 1
        plain.cordon("gpu-2")
        _until("the cordon reaches the scheduler",
               lambda: next(n for n in port.changes(cursor).nodes if n.name == "gpu-2").unschedulable)
        assert _node_lists(api) == 1
    finally:
        port.close()


def test_a_kind_the_server_does_not_serve_reads_as_empty(api: FakeApiServer) -> None:
    custom = client.CustomObjectsApi(_client(api))
    cache = ListWatchCache("podgroup", custom.list_cluster_custom_object, dict,
                           args=("scheduling.x-k8s.io", "v1alpha1", "podgroups"), absent_retry_s=0.05)
    cache.start()
    try:
        assert cache.absent and cache.items() == []
        _until("listed again", lambda: cache.lists >= 3)
    finally:
        cache.stop()
    assert not cache.running
