"""The gang scheduler on the hot path: a gang arriving through the pod watch is bound at once, not at the next tick
of the scheduler's period; a gang whose pods arrive one by one is told "waiting for pods" once, not once per pod; a
bound gang's Event and PodGroup status are written while the next gangs are placed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from healer.gang.config import SchedulerConfig
from healer.gang.port import PodGroupPhase
from healer.gang.scheduler import GangScheduler
from healer.kube.pods import KubePodScheduling
from sim.pods import SimPods
from tests.fake_apiserver import FakeApiServer
from tests.gang_builders import MakePodGroup, gang, rack

COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1")


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.install_crd(*COSCHEDULING)
        for i in range(16):
            server.add_node(f"n{i}")
            server.nodes[f"n{i}"]["spec"]["taints"] = []
            server.nodes[f"n{i}"]["status"]["allocatable"] = {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": "8",
                                                            "pods": "110"}
        yield server


def test_a_gang_arriving_through_the_watch_is_bound_at_once_not_at_the_next_period(api: FakeApiServer) -> None:
    port = KubePodScheduling(client.ApiClient(client.Configuration(host=api.url)), clock=time.time)
    sched = GangScheduler(port=port, is_leader=lambda: True, clock=time.time)
    port.on_change = sched.notice  # as kmend/wiring.py connects them
    port.on_groups_change = sched.wake
    stop = threading.Event()
    thread = threading.Thread(target=sched.run, args=(stop, 60.0), daemon=True)
    thread.start()
    try:
        # The first cycle reads everything and starts the watch; nothing is pending yet.
        deadline = time.monotonic() + 30
        while ("WATCH", "/api/v1/pods") not in api.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        api.add_custom(*COSCHEDULING, "t", "g", {"minMember": 8})
        for i in range(8):
            api.add_pod("t", f"g-{i}", scheduler="kmend", requests={"nvidia.com/gpu": "8"},
                        labels={"scheduling.x-k8s.io/pod-group": "g"})
        deadline = time.monotonic() + 30  # generous for a loaded machine; the period is 60 s
        while time.monotonic() < deadline and not all(
                api.pods[("t", f"g-{i}")]["spec"].get("nodeName") for i in range(8)):
            time.sleep(0.01)
        assert all(api.pods[("t", f"g-{i}")]["spec"].get("nodeName") for i in range(8))
    finally:
        stop.set()
        sched.wake()
        thread.join(10)
        port.close()
    assert not thread.is_alive()


def test_pods_arriving_one_by_one_are_told_waiting_once(tmp_path: object) -> None:
    now = [1000.0]
    sim = SimPods(clock=lambda: now[0])
    for node in rack("l1", 8):
        sim.add_node(node)
    sched = GangScheduler(port=sim, is_leader=lambda: True, clock=lambda: now[0],
                          config=SchedulerConfig(bind_attempts=1), sleep=lambda s: None)
    sim.add_pod_group(MakePodGroup("g").min_member(8).obj())
    pods = gang("g", 8)
    for pod in pods[:-1]:
        sim.add_pod(pod)
        sched.run_once()
        now[0] += 0.05
    waiting = [e for e in sim.events if e.reason == "FailedScheduling"]
    assert len(waiting) == 1 and "waiting for pods: 1 of 8" in waiting[0].message, [e.message for e in waiting]
    sim.add_pod(pods[-1])
    assert sched.run_once().bound_pods == 8
    assert sim.group_status[("train", "g")].phase == PodGroupPhase.SCHEDULED


class _SlowReports(SimPods):
    """SimPods whose Event and PodGroup status writes each take 50 ms, as API round trips do."""

    def emit_event(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.05)
        super().emit_event(*args, **kwargs)

    def set_pod_group_status(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.05)
        super().set_pod_group_status(*args, **kwargs)


def test_a_gang_s_reports_do_not_hold_up_the_next_gang() -> None:
    sim = _SlowReports(clock=lambda: 1000.0)
    for node in rack("l1", 16):
        sim.add_node(node)
    sched = GangScheduler(port=sim, is_leader=lambda: True, clock=lambda: 1000.0,
                          config=SchedulerConfig(bind_attempts=1), sleep=lambda s: None)
    for g in range(8):
        sim.add_pod_group(MakePodGroup(f"g{g}").min_member(2).obj())
        for pod in gang(f"g{g}", 2):
            sim.add_pod(pod)
    start = time.monotonic()
    report = sched.run_once()
    elapsed = time.monotonic() - start
    assert report.bound_pods == 16 and len([e for e in sim.events if e.reason == "Scheduled"]) == 8
    assert all(sim.group_status[("train", f"g{g}")].phase == PodGroupPhase.SCHEDULED for g in range(8))
    # One gang after another, the reports alone take 8 x 2 x 50 ms = 0.8 s.
    assert elapsed < 0.6, elapsed
