"""Scheduler cache against the port: usage, terminating nodes and gangs match a from-scratch build after
binds, deletes, terminations, failed binds, finished pods, node changes and relists."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from healer.cluster import PermanentError
from healer.gang.cache import SchedulerCache
from healer.gang.config import SchedulerConfig
from healer.gang.gangs import Gang, build_gangs
from healer.gang.records import PodRecord, Toleration, TolerationOperator, bound_to
from healer.gang.scheduler import GangScheduler, Outcome
from healer.gang.state import ClusterState
from sim.pods import SimPods
from tests.gang_builders import MakeNode, MakePod, MakePodGroup, gang, rack

CONFIG = SchedulerConfig(bind_attempts=1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _gang_facts(g: Gang) -> tuple[object, ...]:
    return (g.key, [p.name for p in g.pending], sorted(p.name for p in g.bound), g.min_member, g.priority,
            g.created, g.timeout_s, g.required_level, [len(pods) for pods, _ in g.shapes])


def assert_matches(cache: SchedulerCache, sim: SimPods) -> None:
    """The cache's view equals a state and gangs built from scratch over the port's snapshot."""
    snap = sim.snapshot()
    assert {(p.namespace, p.name): p for p in cache.pods()} == {(p.namespace, p.name): p for p in snap.pods}
    ref = ClusterState(snap, CONFIG)
    state, gangs = cache.view()
    assert [n.name for n in state.nodes] == [n.name for n in ref.nodes]
    for name in set(ref.resources) | set(state.resources):
        want = ref.free[:, ref.columns[name]] if name in ref.columns else ref.free[:, 0] * 0
        have = state.free[:, state.columns[name]] if name in state.columns else want * 0
        if name not in ref.columns:
            want = state.allocatable[:, state.columns[name]]
        assert np.array_equal(have, want), name
    assert np.array_equal(state.terminating, ref.terminating)
    assert [_gang_facts(g) for g in gangs] == [_gang_facts(g) for g in build_gangs(snap, CONFIG)]


def setup(nodes: int = 4, *, recreate: bool = False) -> tuple[SimPods, GangScheduler, Clock]:
    clock = Clock()
    sim = SimPods(clock=clock, recreate_deleted=recreate)
    for node in rack("l1", nodes):
        sim.add_node(node)
    return sim, GangScheduler(port=sim, is_leader=lambda: True, clock=clock, config=CONFIG,
                              sleep=lambda s: None), clock


def sync(sched: GangScheduler, sim: SimPods, *, assumed: bool = False) -> None:
    """The cache after reading the port's changes agrees with the port; with ``assumed``, also before
    (right after a cycle, when the scheduler's own binds and deletes are the only changes since)."""
    if assumed:
        assert_matches(sched.cache, sim)
    sched.cache.apply(sim.changes(sched.cache.cursor))
    assert_matches(sched.cache, sim)


def test_bound_to_keeps_every_field() -> None:
    pod = PodRecord("ns", "p", "u", {"cpu": 1}, "", "kmend", True, True, {"a": "b"}, {"c": "d"},
                    (Toleration("k", TolerationOperator.EXISTS),), {"e": "f"}, (), 7, 3.0)
    assert bound_to(pod, "n1") == dataclasses.replace(pod, node_name="n1")


def test_binds_are_assumed_and_then_confirmed() -> None:
    sim, sched, _ = setup()
    sim.add_pod_group(MakePodGroup("g").min_member(3).obj())
    for pod in gang("g", 3):
        sim.add_pod(pod)
    sim.add_pod(MakePod("other").gpus(8).obj())
    assert sched.run_once().bound_pods == 4
    sync(sched, sim, assumed=True)


def test_deletes_and_terminations_keep_resources_until_the_pod_is_gone() -> None:
    sim, sched, _ = setup()
    for pod in gang("g", 2):
        sim.add_pod(pod)
    sched.run_once()
    sim.delete_pod(sim.pod("train", "g-0"))
    sim.add_pod(MakePod("late").gpus(8).obj())
    sched.run_once()
    sync(sched, sim)
    assert sched.cache.view()[0].terminating.sum() == 1
    sim.finish_termination("train", "g-0")
    sim.finish_pod("train", "g-1")
    sync(sched, sim)
    assert not sched.cache.view()[0].terminating.any()


def test_failed_bind_leaves_the_cache_as_the_port_is() -> None:
    sim, sched, _ = setup(recreate=True)
    for pod in gang("g", 4):
        sim.add_pod(pod)
    sim.inject_bind_failure("train", "g-3", PermanentError("admission webhook denied the request"))
    assert sched.run_once().results[0].outcome == Outcome.RELEASED
    sync(sched, sim, assumed=True)
    for p in sim.pods():
        sim.finish_termination(p.namespace, p.name)
    assert sched.run_once().bound_pods == 4
    sync(sched, sim, assumed=True)


def test_node_changes_new_resources_and_relists() -> None:
    sim, sched, _ = setup(nodes=2)
    sim.add_pod(MakePod("fpga").request("example.com/fpga", 1).obj())
    sim.add_pod(MakePod("w").gpus(8).obj())
    sched.run_once()
    sim.add_node(MakeNode("l2-n0").leaf("l2").resource("example.com/fpga", 2).obj())
    sim.add_pod(MakePod("w2").gpus(8).on("l2-n0").scheduler("default").obj())
    sync(sched, sim)
    sched.run_once()
    sync(sched, sim)
    stale = SchedulerCache(CONFIG)
    stale.apply(sim.changes(""))
    sim.delete_pod(sim.pod("train", "w"))
    sim.finish_termination("train", "w")
    stale.apply(sim.changes(""))  # a full list must drop what is gone
    assert_matches(stale, sim)


def test_random_operations_keep_the_cache_consistent() -> None:
    rng = random.Random(5)
    sim, sched, clock = setup(nodes=12, recreate=True)
    for leaf in ("l2", "l3"):
        for node in rack(leaf, 6, spine="s2"):
            sim.add_node(node)
    made = 0
    for step in range(60):
        op = rng.random()
        if op < 0.35:
            made += 1
            n, gpus = rng.choice(((1, 8), (2, 4), (4, 8), (3, 2))), rng.choice((1, 2, 8))
            if rng.random() < 0.5:
                sim.add_pod_group(MakePodGroup(f"j{made}").min_member(n[0]).created(clock.now).obj())
            for pod in gang(f"j{made}", n[0], n[1] if gpus == 8 else gpus, created=clock.now):
                sim.add_pod(pod)
        elif op < 0.55:
            live = [p for p in sim.pods() if p.node_name]
            if live:
                sim.delete_pod(rng.choice(live))
        elif op < 0.7:
            live = [p for p in sim.pods() if p.node_name and not p.terminating]
            if live:
                p = rng.choice(live)
                sim.finish_pod(p.namespace, p.name)
        elif op < 0.8:
            pending = [p for p in sim.pods() if not p.node_name]
            if pending:
                p = rng.choice(pending)
                sim.inject_bind_failure(p.namespace, p.name, PermanentError("denied"))
        else:
            clock.now += 31
            sim.tick()
        sched.run_once()
        if step % 3 == 0:
            sync(sched, sim)
    sync(sched, sim)
