"""API calls on the hot paths: binds, deletes and Events read their answers to the end, so the keep-alive connection
goes back to the client's pool instead of a new one (a TLS handshake on a real server) per request; the pool holds as
many connections as the scheduler binds in parallel; the breaker's list of quarantined nodes is selected by label on
the server, not read as the whole fleet."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from healer.gang.config import SchedulerConfig
from healer.gang.port import ObjectRef
from healer.kube.cluster import KubeCluster
from healer.kube.pods import KubePodScheduling
from tests.fake_apiserver import FakeApiServer
from tests.procs import write_kubeconfig


@pytest.fixture
def api() -> Iterator[tuple[FakeApiServer, list[int]]]:
    """The loopback API server, and a count of the TCP connections it accepted."""
    with FakeApiServer() as server:
        accepted = [0]
        lock = threading.Lock()
        process = server.httpd.process_request

        def counted(request: Any, address: Any) -> None:
            with lock:
                accepted[0] += 1
            process(request, address)

        server.httpd.process_request = counted  # type: ignore[method-assign]
        yield server, accepted


def _port(server: FakeApiServer) -> KubePodScheduling:
    return KubePodScheduling(client.ApiClient(client.Configuration(host=server.url)), clock=time.time)


def test_binds_deletes_and_events_reuse_one_connection(api: tuple[FakeApiServer, list[int]]) -> None:
    server, accepted = api
    for i in range(40):
        server.add_node(f"n{i}")
        server.add_pod("t", f"p-{i}", scheduler="kmend")
    port = _port(server)
    pods = {p.name: p for p in port.snapshot().pods}
    for i in range(30):
        port.bind(pods[f"p-{i}"], f"n{i}")
    for i in range(30, 40):
        port.delete_pod(pods[f"p-{i}"])
        port.emit_event(ObjectRef("Pod", "t", f"p-{i}"), "Scheduled", "bound")
    assert all(server.pods[("t", f"p-{i}")]["spec"].get("nodeName") == f"n{i}" for i in range(30))
    assert accepted[0] <= 2, f"{accepted[0]} connections for 51 requests"


def test_binds_from_eight_workers_stay_on_eight_connections_on_a_one_cpu_host(
        api: tuple[FakeApiServer, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server, accepted = api
    for i in range(160):
        server.add_node(f"n{i}")
        server.add_pod("t", f"p-{i}", scheduler="kmend")
    # The client sizes its pool by the CPUs it sees: a pod limited to one CPU would get five connections.
    monkeypatch.setattr(multiprocessing, "cpu_count", lambda: 1)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server.url)
    api_client = KubeCluster.from_config(str(kubeconfig)).api
    assert api_client.configuration.connection_pool_maxsize >= SchedulerConfig().bind_workers + 2
    port = KubePodScheduling(api_client, clock=time.time)
    pods = sorted(port.snapshot().pods, key=lambda p: p.name)
    with ThreadPoolExecutor(SchedulerConfig().bind_workers) as pool:
        list(pool.map(lambda i: port.bind(pods[i], f"n{i}"), range(160)))
    assert all(p["spec"].get("nodeName") for p in server.pods.values())
    assert accepted[0] <= 9, f"{accepted[0]} connections for 161 requests from 8 threads"


def test_quarantined_nodes_are_selected_by_label_on_the_server(api: tuple[FakeApiServer, list[int]]) -> None:
    server, _ = api
    for i in range(50):
        server.add_node(f"n{i}", {"kmend.io/quarantined": "true"} if i % 10 == 0 else {})
    cluster = KubeCluster(client.ApiClient(client.Configuration(host=server.url)))
    before = len(server.requests)
    out = cluster.list_nodes({"kmend.io/quarantined": "true"})
    assert sorted(n.name for n in out) == ["n0", "n10", "n20", "n30", "n40"]
    assert [r for r in server.requests[before:]] == [("GET", "/api/v1/nodes")]
    assert len(cluster.list_nodes()) == 50
