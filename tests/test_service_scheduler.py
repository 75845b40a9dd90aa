"""The gang scheduler inside `kmend serve`: it places pending gangs while the app runs, only as Lease holder."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from healer.gang.records import PodRecord
from healer.lease import AlwaysLeader
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from sim.pods import SimPods
from tests.gang_builders import MakeNode, gang


class NeverLeader(AlwaysLeader):
    def is_leader(self) -> bool:
        return False

    def tick(self) -> bool:
        return False


def _pods() -> SimPods:
    port = SimPods(clock=time.time)
    for i in range(8):
        port.add_node(MakeNode(f"n{i}").gpus(8).leaf(f"leaf-{i // 4}").obj())
    for pod in gang("pg-llama", 4, scheduler_name="kmend"):
        port.add_pod(pod)
    return port


def _bound(port: SimPods) -> list[PodRecord]:
    return [p for p in port.pods() if p.node_name]


def _serve_with(tmp_path: Path, port: SimPods, leader: AlwaysLeader) -> str:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", scheduler_interval_s=0.05)
    kmend = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier(), leader=leader,
                       pod_scheduling=port)
    assert kmend.scheduler is not None
    with serve_in_thread(create_app(kmend, settings)) as url:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(_bound(port)) < 4:
            time.sleep(0.05)
        if isinstance(leader, NeverLeader):
            time.sleep(0.3)
        text = httpx.get(f"{url}/metrics").text
    kmend.store.close()
    return text


def test_the_service_binds_a_pending_gang_in_one_leaf(tmp_path: Path) -> None:
    port = _pods()
    text = _serve_with(tmp_path, port, AlwaysLeader())
    bound = _bound(port)
    assert len(bound) == 4
    nodes = {p.node_name for p in bound}
    assert len(nodes) == 4 and (nodes == {"n0", "n1", "n2", "n3"} or nodes == {"n4", "n5", "n6", "n7"})
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples["kmend_scheduler_pods_bound_total"] == 4
    assert samples["kmend_scheduler_gangs_placed_total"] == 1


def test_a_replica_without_the_lease_binds_nothing(tmp_path: Path) -> None:
    port = _pods()
    _serve_with(tmp_path, port, NeverLeader())
    assert _bound(port) == []
