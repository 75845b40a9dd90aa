"""Gang scheduler benchmark: prints one JSON object per result.

A simulated 4,096-node cluster (8 GPUs per node, 32 nodes per leaf, 16 leaves per spine, 4 spines
per zone, one spare per leaf) fragmented the way busy training clusters are: whole nodes held by
large jobs in runs, partly used nodes from small jobs, a few cordoned nodes and terminating pods.

Results:
- ``one_gang``: one 1,024-pod gang of 8-GPU pods, one full cycle (snapshot, place, bind through
  the in-memory port), target < 1 s;
- ``mixed_queue``: 500 gangs of 1-512 pods (log-uniform sizes), placed as running jobs finish,
  pods bound per second of scheduler time, target >= 5,000 pods/s;
- ``topology``: leaves spanned against the fewest leaves that could hold each placement.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time

from healer.cluster import Taint
from healer.gang.config import SchedulerConfig
from healer.gang.placement import Placement
from healer.gang.quantity import CPU, GPU, MEMORY, PODS
from healer.gang.records import POD_GROUP_LABEL, NodeRecord, PodGroupRecord, PodRecord
from healer.gang.scheduler import GangScheduler, Outcome
from sim.pods import SimPods

SPINES, LEAVES, NODES, ZONE_SPINES = 8, 16, 32, 4


class Clock:
    """Simulated time."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def cluster(rng: random.Random, clock: Clock) -> SimPods:
    """4,096 nodes with fragmentation."""
    sim = SimPods(clock=clock, grace_s=30.0)
    seq = 0
    for s in range(SPINES):
        for lf in range(LEAVES):
            leaf = f"s{s}-l{lf}"
            for n in range(NODES):
                name = f"{leaf}-n{n}"
                spare = n == NODES - 1
                labels = {"topology.kmend.io/leaf": leaf, "topology.kmend.io/spine": f"s{s}",
                          "topology.kmend.io/zone": f"z{s // ZONE_SPINES}"}
                taints: tuple[Taint, ...] = ()
                if spare:
                    labels["kmend.io/spare"] = "true"
                    taints = (Taint("kmend.io/spare", "true", "NoSchedule"),)
                sim.add_node(NodeRecord(name, {CPU: 192_000, MEMORY: 2 * 2**40, PODS: 110, GPU: 8,
                                               "rdma/ib": 8}, labels, taints,
                                        unschedulable=rng.random() < 0.01))
                if spare:
                    continue
                # Leaves differ: some nearly full of big jobs, some half used, some idle.
                busy = (0.85, 0.5, 0.2, 0.0)[(s * LEAVES + lf) % 4]
                r = rng.random()
                used = 8 if r < busy else (rng.choice((1, 2, 4, 6)) if r < busy + 0.2 else 0)
                while used:
                    g = min(used, rng.choice((1, 2, 4, 8)))
                    seq += 1
                    sim.add_pod(PodRecord("base", f"base-{seq}", requests={GPU: g, CPU: 8000 * g},
                                          node_name=name, scheduler_name="default-scheduler",
                                          terminating=rng.random() < 0.005))
                    used -= g
    return sim


def add_gang(sim: SimPods, name: str, n: int, gpus: int, created: float) -> None:
    sim.add_pod_group(PodGroupRecord("train", name, min_member=n, created=created))
    for i in range(n):
        sim.add_pod(PodRecord("train", f"{name}-{i}", requests={GPU: gpus, CPU: 8000 * gpus, "rdma/ib": gpus,
                                                               MEMORY: 64 * 2**30 * gpus},
                              scheduler_name="kmend", labels={POD_GROUP_LABEL: name}, created=created))


def scheduler(sim: SimPods, clock: Clock) -> GangScheduler:
    # Binding is in memory here, so threads would only add overhead.
    return GangScheduler(port=sim, is_leader=lambda: True, clock=clock,
                         config=SchedulerConfig(bind_workers=1))


def one_gang(seed: int) -> dict[str, object]:
    rng, clock = random.Random(seed), Clock()
    sim = cluster(rng, clock)
    add_gang(sim, "big", 1024, 8, clock.now)
    report = scheduler(sim, clock).run_once()
    (result,) = report.results
    p = result.placement
    assert result.outcome == Outcome.BOUND and p is not None, result.reason
    return {"bench": "gang.one_gang", "nodes": 4096, "pods": 1024, "gpus_per_pod": 8,
            "base_pods": len(sim.pods()) - 1024, "cycle_s": round(report.seconds, 4), "target_s": 1.0,
            "leaves": p.leaves, "leaves_lower_bound": p.leaves_lower_bound, "level": p.level.name.lower()}


def mixed_queue(seed: int, gangs: int = 500) -> tuple[dict[str, object], list[Placement]]:
    rng, clock = random.Random(seed), Clock()
    sim = cluster(rng, clock)
    sched = scheduler(sim, clock)
    sizes: dict[str, int] = {}
    for g in range(gangs):
        n = min(512, max(1, round(math.exp(rng.uniform(0, math.log(512))))))
        gpus = 8 if n >= 8 else rng.choice((1, 2, 4, 8))
        sizes[f"job{g}"] = n
        add_gang(sim, f"job{g}", n, gpus, clock.now + g)
    ends: dict[str, float] = {}
    placements: list[Placement] = []
    busy = cpu = 0.0
    cycles = 0
    while len(placements) < gangs and cycles < 10_000:
        c0 = time.process_time()
        report = sched.run_once()
        cpu += time.process_time() - c0
        busy += report.seconds
        cycles += 1
        for r in report.results:
            if r.outcome == Outcome.BOUND and r.placement is not None:
                placements.append(r.placement)
                ends[r.gang.split("/")[1]] = clock.now + rng.uniform(600, 3600)
        # Jump to the next batch of finishing jobs (the scheduler runs every few minutes of them).
        if len(placements) < gangs:
            clock.now = max(clock.now + 300, min(ends.values(), default=clock.now))
            for job, end in list(ends.items()):
                if end <= clock.now:
                    for i in range(sizes[job]):
                        sim.finish_pod("train", f"{job}-{i}")
                    del ends[job]
            sim.tick()
    pods = sum(len(p.bindings) for p in placements)
    return ({"bench": "gang.mixed_queue", "nodes": 4096, "gangs": gangs, "gangs_placed": len(placements),
             "pods": pods, "cycles": cycles, "scheduler_s": round(busy, 3), "scheduler_cpu_s": round(cpu, 3),
             "pods_per_s": round(pods / busy), "pods_per_cpu_s": round(pods / cpu), "target_pods_per_s": 5000,
             "kube_scheduler_floor_pods_per_s": "680-810 at 5,000 nodes"}, placements)


def topology(placements: list[Placement]) -> dict[str, object]:
    excess = [p.leaves - p.leaves_lower_bound for p in placements]
    return {"bench": "gang.topology", "placements": len(placements),
            "mean_leaves": round(statistics.fmean(p.leaves for p in placements), 3),
            "mean_excess_leaves": round(statistics.fmean(excess), 3), "max_excess_leaves": max(excess),
            "at_lower_bound": sum(1 for e in excess if e <= 0)}


def main() -> None:
    print(json.dumps(one_gang(7)), flush=True)
    start = time.perf_counter()
    result, placements = mixed_queue(11)
    result["wall_s"] = round(time.perf_counter() - start, 2)
    print(json.dumps(result), flush=True)
    print(json.dumps(topology(placements)), flush=True)


if __name__ == "__main__":
    main()
