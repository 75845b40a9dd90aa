"""Gang scheduler loop on SimPods: whole gangs bound, half-bound ones released, reasons, the Lease."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from healer.cluster import PermanentError, TemporaryError
from healer.gang.config import SchedulerConfig
from healer.gang.metrics import SchedulerMetrics
from healer.gang.port import PodGroupPhase, UncertainError
from healer.gang.reason import TIMES
from healer.gang.reservations import ReservationBook
from healer.gang.scheduler import GangScheduler, Outcome
from sim.pods import SimPods
from tests.gang_builders import MakeNode, MakePod, MakePodGroup, gang, rack


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def setup(nodes: int = 4, *, leader: bool = True, recreate: bool = False,
          book: ReservationBook | None = None) -> tuple[SimPods, GangScheduler, Clock]:
    clock = Clock()
    sim = SimPods(clock=clock, recreate_deleted=recreate)
    for node in rack("l1", nodes):
        sim.add_node(node)
    sched = GangScheduler(port=sim, is_leader=lambda: leader, clock=clock, reservations=book,
                          config=SchedulerConfig(bind_attempts=1), sleep=lambda s: None)
    return sim, sched, clock


def test_binds_a_whole_gang_and_reports_scheduled() -> None:
    sim, sched, _ = setup()
    sim.add_pod_group(MakePodGroup("g").min_member(4).obj())
    for pod in gang("g", 4):
        sim.add_pod(pod)
    report = sched.run_once()
    assert [r.outcome for r in report.results] == [Outcome.BOUND]
    assert report.bound_pods == 4 and sim.binds == 4
    assert {p.node_name for p in sim.pods()} == {f"l1-n{i}" for i in range(4)}
    assert sim.group_status[("train", "g")].phase == PodGroupPhase.SCHEDULED


def test_failed_bind_releases_the_bound_members() -> None:
    sim, sched, _ = setup(recreate=True)
    for pod in gang("g", 4):
        sim.add_pod(pod)
    sim.inject_bind_failure("train", "g-2", PermanentError("admission webhook denied the request"))
    report = sched.run_once()
    (result,) = report.results
    assert result.outcome == Outcome.RELEASED
    pods = sim.pods()
    # Nothing of the gang is left running: bound members are terminating, the rest are pending.
    assert all(p.terminating or not p.node_name for p in pods)
    assert [e.reason for e in sim.events] == ["FailedBinding"]
    # Once the kubelet has finished the old pods, the recreated gang is placed whole.
    for p in pods:
        sim.finish_termination(p.namespace, p.name)
    assert sched.run_once().bound_pods == 4


def test_uncertain_bind_is_released_too() -> None:
    sim, sched, _ = setup()
    sim.add_pod(MakePod("solo-0").group("solo").gpus(8).obj())
    sim.add_pod(MakePod("solo-1").group("solo").gpus(8).obj())
    sim.inject_bind_failure("train", "solo-1", UncertainError("read timed out"))
    result = sched.run_once().results[0]
    assert result.outcome == Outcome.RELEASED
    assert not any(p.node_name and not p.terminating for p in sim.pods())


def test_retryable_bind_error_is_retried_per_policy() -> None:
    sim, sched, _ = setup()
    sched.config = SchedulerConfig(bind_attempts=2)
    for pod in gang("g", 2):
        sim.add_pod(pod)
    sim.inject_bind_failure("train", "g-1", TemporaryError("etcdserver: request timed out (503)"))
    assert sched.run_once().bound_pods == 2


def test_unschedulable_gang_gets_event_and_status_once_per_reason() -> None:
    sim, sched, clock = setup(nodes=2)
    sim.add_pod_group(MakePodGroup("big").min_member(3).obj())
    for pod in gang("big", 3):
        sim.add_pod(pod)
    sched.run_once()
    sched.run_once()
    reason = f"needs 3 pods {TIMES} 8 GPUs; room for 2 (best spine 2, best leaf 2)"
    events = [(e.reason, e.message, e.ref.kind) for e in sim.events]
    assert events == [("FailedScheduling", reason, "PodGroup")]
    status = sim.group_status[("train", "big")]
    assert (status.phase, status.reason) == (PodGroupPhase.PENDING, reason)
    clock.now += 61
    sched.run_once()
    assert len(sim.events) == 2


def test_partly_bound_gang_is_released_after_its_timeout() -> None:
    sim, sched, clock = setup(nodes=2)
    sim.add_pod_group(MakePodGroup("g").min_member(3).timeout(30).created(clock.now).obj())
    # One member was bound before a crash; two remain pending but only one node is free.
    sim.add_pod(MakePod("g-0").group("g").gpus(8).on("l1-n0").obj())
    sim.add_pod(MakePod("g-1").group("g").gpus(8).obj())
    sim.add_pod(MakePod("g-2").group("g").gpus(8).obj())
    assert sched.run_once().results[0].outcome == Outcome.UNSCHEDULABLE
    clock.now += 31
    assert sched.run_once().results[0].outcome == Outcome.TIMED_OUT
    assert sim.pod("train", "g-0").terminating


def test_follower_does_nothing() -> None:
    sim, sched, _ = setup(leader=False)
    sim.add_pod(MakePod("p").gpus(8).obj())
    report = sched.run_once()
    assert not report.leader and sim.binds == 0 and not sim.events


def test_reservation_is_released_once_the_restarted_gang_is_bound() -> None:
    book = ReservationBook()
    sim, sched, clock = setup(book=book)
    sim.add_node(MakeNode("spare").leaf("l1").spare().obj())
    book.hold("train/job", ["l1-n0", "l1-n1", "l1-n2"], failed=["l1-n3"], until=clock.now + 600)
    sim.add_pod(MakePod("thief").gpus(8).created(1).obj())
    for pod in gang("job", 4, created=2.0):
        sim.add_pod(pod)
    report = sched.run_once()
    outcomes = {r.gang: r.outcome for r in report.results}
    assert outcomes == {"train/thief": Outcome.BOUND, "train/job": Outcome.BOUND}
    assert sim.pod("train", "thief").node_name == "l1-n3"
    assert {sim.pod("train", f"job-{i}").node_name for i in range(4)} == {"l1-n0", "l1-n1", "l1-n2", "spare"}
    assert book.get("train/job") is None


def test_metrics_count_cycles_gangs_pods_and_failures() -> None:
    registry = CollectorRegistry()
    sim, sched, _ = setup(nodes=2)
    sched.metrics = SchedulerMetrics(registry)
    for pod in gang("g", 2):
        sim.add_pod(pod)
    for pod in gang("h", 2):
        sim.add_pod(pod)
    sim.add_pod(MakePod("solo").gpus(8).obj())
    sched.run_once()
    sim.inject_bind_failure("train", "h-0", PermanentError("denied"))
    for p in sim.pods():
        if p.node_name:
            sim.finish_pod(p.namespace, p.name)
    sched.run_once()

    def value(name: str) -> float | None:
        return registry.get_sample_value(name)

    assert value("kmend_scheduler_cycle_duration_seconds_count") == 2
    # g is placed; h is placed but released when a bind fails, and its slots stay taken for solo
    # until the next cycle sees what the release left.
    assert value("kmend_scheduler_gangs_placed_total") == 1
    assert value("kmend_scheduler_pods_bound_total") == 2
    assert value("kmend_scheduler_bind_failures_total") == 1
    assert value("kmend_scheduler_gangs_pending") == 2
