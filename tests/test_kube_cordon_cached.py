"""Signal → cordon reads (official client, loopback fake API server): with the node cache, the healer's decision
reads the node from the watch and the cordon is one PATCH preconditioned on the version it checked; a node opted out
(``kmend.io/managed=false``) or changed since the cache saw it is read again and judged on its current version."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

from healer.cluster import PermanentError
from healer.keys import MANAGED_LABEL
from healer.kube.cluster import KubeCluster
from tests.fake_apiserver import FakeApiServer


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        for i in range(3):
            server.add_node(f"gpu-{i}")
        yield server


@pytest.fixture
def cluster(api: FakeApiServer) -> Iterator[KubeCluster]:
    kube = KubeCluster(client.ApiClient(client.Configuration(host=api.url)), node_cache=True)
    kube.list_nodes()  # the cache lists and starts its watch
    yield kube
    kube.close()


def _until(what: str, pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _node_requests(api: FakeApiServer, node: str) -> list[str]:
    return [method for method, path in api.requests if path == f"/api/v1/nodes/{node}"]


def _change_unseen(api: FakeApiServer, node: str, labels: dict[str, str]) -> None:
    """A write the watch has not delivered yet: the cache still holds the older version."""
    with api._lock:
        stored = api.nodes[node]
        stored["metadata"]["labels"] = {**stored["metadata"].get("labels", {}), **labels}
        stored["metadata"]["resourceVersion"] = str(next(api._rv))


def test_the_decision_read_and_the_cordon_cost_one_request(api: FakeApiServer, cluster: KubeCluster) -> None:
    _until("the node watch running", lambda: ("WATCH", "/api/v1/nodes") in api.requests)
    assert cluster.peek_node("gpu-1").name == "gpu-1"
    cluster.cordon("gpu-1")
    assert _node_requests(api, "gpu-1") == ["PATCH"]
    assert api.nodes["gpu-1"]["spec"]["unschedulable"] is True
    cluster.cordon("gpu-1")  # idempotent once the watch has the cordoned version
    assert api.nodes["gpu-1"]["spec"]["unschedulable"] is True


def test_a_node_opted_out_after_the_cache_saw_it_is_not_cordoned(api: FakeApiServer, cluster: KubeCluster) -> None:
    _change_unseen(api, "gpu-2", {MANAGED_LABEL: "false"})
    assert MANAGED_LABEL not in cluster.peek_node("gpu-2").labels  # the stale view the decision was made on
    with pytest.raises(PermanentError, match="managed=false"):
        cluster.cordon("gpu-2")
    assert not api.nodes["gpu-2"]["spec"].get("unschedulable")
    assert _node_requests(api, "gpu-2") == ["PATCH", "GET"]  # refused at the cached version, judged on the current


def test_a_node_changed_otherwise_is_cordoned_at_its_current_version(api: FakeApiServer, cluster: KubeCluster) -> None:
    _change_unseen(api, "gpu-0", {"team": "a"})
    cluster.cordon("gpu-0")
    assert api.nodes["gpu-0"]["spec"]["unschedulable"] is True
    assert api.nodes["gpu-0"]["metadata"]["labels"]["team"] == "a"
    assert _node_requests(api, "gpu-0") == ["PATCH", "GET", "PATCH"]
