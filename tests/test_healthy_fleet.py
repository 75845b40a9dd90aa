"""The false-alarm fleet (sim/healthy_fleet.py): judging only the silences a hang is possible in gives the same
findings as evaluating the real detectors every second, and a real stall in a healthy fleet is not screened out."""

from __future__ import annotations

import numpy as np
import pytest

from analyzer.detectors.suite import DetectorSuite
from analyzer.records import FaultClass, Finding
from sim.healthy_fleet import KINDS, Timeline, _events, add_stacks, draw_job, judge, look, run_fleet


def _every_second(tl: Timeline, job: str) -> list[Finding]:
    """The whole run fed to one suite in time order, evaluated once a second as the service does; each
    silence's stacks are added when they arrive: the first look, and each newer one the service asks for."""
    nodes = [f"{job}-node-{r // 8}" for r in range(tl.kind.world)]
    evs = _events(tl, job, 0, len(tl.ts) - 1, tl.end_ts + 600.0, np.random.default_rng(0), nodes)
    suite = DetectorSuite()
    found: list[Finding] = []
    silence, asked, added = -1, set[int](), set[int]()
    i, t = 0, evs[0].ts
    while t <= tl.end_ts + 600.0:
        j = i
        while j < len(evs) and evs[j].ts <= t:
            j += 1
        suite.observe_digest(evs[i:j], [], t)
        first = look(suite, tl, job, 0)
        if first is not None:
            if first[2] != silence:  # a new silence: its looks start again
                silence, asked, added = first[2], {0}, set()
            asked.add(suite.evidence_round(f"fleet/{job}", t))  # the look the service asks for now
            for n in sorted(asked - added):
                got = look(suite, tl, job, n)
                if got is not None and got[1] <= t:
                    added.add(n)
                    add_stacks(suite, tl, job, nodes, n)
        found += suite.evaluate(t)
        i, t = j, t + 1.0
    return found


@pytest.mark.parametrize(("kind", "stall_s", "restart", "deleted", "hang"), [
    (5, 12.0, True, False, True),   # 5 s steps, a 17 s silence: one rank still stalled when the stacks are taken
    (5, 9.0, True, False, False),   # a 14 s silence, but the stacks (~9 s in) show every rank computing again
    (5, 2.0, False, True, False),   # 5 s steps, a 7 s silence: no hang
    (1, 12.0, True, True, True),    # 2.5 s reports (Trainer logging every 10 steps), a 14.5 s silence
    (4, 30.0, False, False, True),  # 2 s steps, a 32 s silence
])
def test_judging_the_long_silences_finds_what_evaluating_every_second_finds(
        kind: int, stall_s: float, restart: bool, deleted: bool, hang: bool) -> None:
    tl = draw_job(np.random.default_rng(kind), KINDS[kind], 0.6, restart=restart, deleted=deleted,
                  stall_at=0.7, stall_s=stall_s)
    fast, _ = judge(tl, "j", np.random.default_rng(0))
    slow = _every_second(tl, "j")
    key = [(f.fault_class, f.fields.get("last_step")) for f in fast]
    assert key == [(f.fault_class, f.fields.get("last_step")) for f in slow]
    assert bool(key) == hang  # the stall made the only silence over the threshold


@pytest.mark.parametrize("kind", range(len(KINDS)))
def test_every_kind_of_job_is_judged_alike_both_ways(kind: int) -> None:
    rng = np.random.default_rng(100 + kind)
    tl = draw_job(rng, KINDS[kind], 0.3 if KINDS[kind].step_s < 1 else 1.0, restart=True,
                  deleted=bool(kind % 2), stall_at=0.8, stall_s=float(rng.uniform(5.0, 25.0)))
    fast, _ = judge(tl, "j", np.random.default_rng(0))
    def key(found: list[Finding]) -> list[tuple[str, str | None, str | None]]:
        return [(f.rule_id, f.fields.get("last_step"), f.fields.get("mode")) for f in found]

    assert key(fast) == key(_every_second(tl, "j"))


def test_a_stalled_job_in_a_healthy_fleet_is_found() -> None:
    hours, _, found, judged = run_fleet(30, seed=3, stall_s=40.0)
    assert hours >= 30 and judged["announced_pauses"] > 0
    # The hang finding, and the stacks taken in the stall (one rank in its own code, the others in all-reduce)
    # as a second finding that names that rank.
    assert sorted((f.rule_id, f.fault_class, f.where.job) for f in found) == [
        ("hang-detector", FaultClass.HANG, "healthy-3-0"), ("stack-dump", FaultClass.HANG, "healthy-3-0")]
    stacked = next(f for f in found if f.rule_id == "stack-dump")
    assert stacked.where.rank is not None and "read_shard" in stacked.message
