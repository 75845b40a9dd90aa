"""Indexed correlation: the same incidents as comparing each finding with every open incident, and fast with
10,000 open; quiet incidents resolve on their own."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest

from analyzer.correlate import Correlator
from analyzer.records import (
    Action,
    FaultClass,
    Finding,
    Incident,
    IncidentState,
    Location,
    Severity,
    TimelineEntry,
)

T0 = 1_700_000_000.0
NODES = ("n1", "n2", "n3", "n4", None)
JOBS = ("ja", "jb", "jc", None)
CAUSES = (FaultClass.GPU_LOST, FaultClass.NVLINK, FaultClass.NETWORK, FaultClass.APP_ERROR)
NCCL_SYMPTOM_OF = frozenset({FaultClass.GPU_LOST, FaultClass.NVLINK, FaultClass.NETWORK, FaultClass.HANG})
SYMPTOMS = (
    (FaultClass.NCCL_TIMEOUT, "nccl-watchdog-timeout", NCCL_SYMPTOM_OF),
    (FaultClass.NCCL_ERROR, "nccl-remote-error", NCCL_SYMPTOM_OF | {FaultClass.NCCL_TIMEOUT}),
    (FaultClass.HANG, "hang-detector", frozenset({FaultClass.GPU_LOST, FaultClass.NETWORK})),
    (FaultClass.NCCL_TIMEOUT, "flight-recorder", frozenset({FaultClass.GPU_LOST})),
    (FaultClass.STRAGGLER, "straggler", frozenset({FaultClass.NVLINK})),
)


def _finding(rng: random.Random, n: int, ts: float) -> Finding:
    node, job = rng.choice(NODES), rng.choice(JOBS)
    where = Location(node=node, job=job, gpu=rng.choice(("0", "1", None)), rank=rng.choice((None, 0, 1, 2, 3)))
    if rng.random() < 0.45:
        fc = rng.choice(CAUSES)
        return Finding(f"f{n}", ts, fc, Severity.ERROR, fc is not FaultClass.APP_ERROR, where, f"rule-{fc.value}",
                       rng.choice((Action.NOTIFY, Action.REPLACE_NODE, Action.FIX_APPLICATION)), (f"s{n}",))
    fc, rule, symptom_of = rng.choice(SYMPTOMS)
    return Finding(f"f{n}", ts, fc, Severity.WARNING, False, where, rule, Action.NOTIFY, (f"s{n}",),
                   symptom_of=symptom_of)


def _same(a: Sequence[Incident], b: Sequence[Incident]) -> None:
    assert [i.id for i in a] == [i.id for i in b]
    assert list(a) == list(b)


@pytest.mark.parametrize("bundle", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_the_index_folds_exactly_like_comparing_with_every_open_incident(seed: int, bundle: bool) -> None:
    rng = random.Random(seed)
    window = 60.0
    fast = Correlator(window_s=window, bundle=bundle, max_incidents=30)
    scan = Correlator(window_s=window, bundle=bundle, max_incidents=30, index=False)
    ts, made = T0, 0
    for _ in range(120):
        ts += rng.expovariate(1 / 12.0)
        op = rng.random()
        if op < 0.15:
            job, node = rng.choice(JOBS[:-1]), rng.choice(NODES[:-1])
            at = None if bundle and rng.random() < 0.3 else ts - rng.uniform(0, 2 * window)
            for c in (fast, scan):
                c.observe_placement(job, node, at)  # type: ignore[arg-type]
        elif op < 0.22 and (live := scan.incidents()):
            inc = rng.choice(live)
            state = rng.choice(list(IncidentState))
            _same([fast.set_state(inc.id, state, ts, "test")], [scan.set_state(inc.id, state, ts, "test")])
        elif op < 0.25:
            before = ts - rng.uniform(0, 3 * window)
            _same(fast.resolve_quiet(before, ts), scan.resolve_quiet(before, ts))
        else:
            batch = []
            for _ in range(rng.randint(1, 4)):
                if made and rng.random() < 0.05:
                    batch.append(_finding(random.Random(rng.randrange(made)), 0, ts))  # a redelivered id
                made += 1
                batch.append(_finding(rng, made, ts - rng.uniform(0, window)))
            _same(fast.add_all(batch), scan.add_all(batch))
            assert fast.take_merges() == scan.take_merges()
        _same(fast.incidents(), scan.incidents())
        _same(fast.active(), [i for i in scan.incidents() if i.state in (IncidentState.OPEN,
                                                                           IncidentState.REMEDIATING)])
    # A restart puts the live incidents back; folding goes on the same way from there.
    again_fast = Correlator(window_s=window, bundle=bundle)
    again_scan = Correlator(window_s=window, bundle=bundle, index=False)
    for inc in scan.incidents():
        again_fast.restore(inc)
        again_scan.restore(inc)
    for _ in range(30):
        ts += rng.expovariate(1 / 12.0)
        made += 1
        f = _finding(rng, made, ts)
        _same(again_fast.add_all([f]), again_scan.add_all([f]))
        assert again_fast.take_merges() == again_scan.take_merges()
    _same(again_fast.incidents(), again_scan.incidents())


def _open_incident(i: int, nodes: int) -> Incident:
    node = f"gpu-node-{i % nodes:04d}"
    fc = CAUSES[i % 3]
    f = Finding(f"old-{i}", T0 + i * 0.1, fc, Severity.ERROR, True, Location(node=node, gpu=str(i // nodes % 8),
                job=f"job-{i % nodes // 8}"), f"rule-{fc.value}", Action.NOTIFY, (f"old-s{i}",))
    return Incident(id=f"inc-old-{i}", fault_class=fc, severity=Severity.ERROR, hardware=True,
                    recommended_action=Action.NOTIFY, root_cause=f.where, opened_at=f.ts, updated_at=f.ts,
                    findings=(f,), timeline=(TimelineEntry(f.ts, "opened"),))


def test_folding_stays_fast_with_ten_thousand_open_incidents() -> None:
    # A month of notify-only faults on a 1,000-node fleet left open: every new finding was compared with
    # each of them (223 findings/s with 4,900 open). Now only the incidents it can join are looked at.
    c = Correlator()
    for i in range(10_000):
        c.restore(_open_incident(i, 1000))
    rng = random.Random(7)
    new = []
    for n in range(3000):
        f = _finding(rng, n, T0 + 1000 + n * 0.01)
        node = f"gpu-node-{rng.randrange(1000):04d}"
        new.append(Finding(f.id, f.ts, f.fault_class, f.severity, f.hardware,
                           Location(node=node, job=f"job-{int(node[-4:]) // 8}", gpu=f.where.gpu, rank=f.where.rank),
                           f.rule_id, f.recommended_action, f.evidence, symptom_of=f.symptom_of))
    t = time.process_time()  # CPU time: a loaded machine's wait for a core is not the correlator's cost
    for i in range(0, len(new), 100):
        c.add_all(new[i:i + 100])
    dt = time.process_time() - t
    assert len(c.incidents()) >= 10_000
    # 3,000 findings: about 0.1 s of CPU here; comparing with every open incident took over 10 s.
    assert dt < 3.0, f"{len(new)} findings took {dt:.2f} s with 10,000 open incidents"


def test_an_incident_quiet_for_the_configured_time_resolves_and_a_remediating_or_kept_one_does_not() -> None:
    c = Correlator(window_s=60)
    mk = [Finding(f"x{i}", T0 + i, FaultClass.GPU_LOST, Severity.ERROR, True, Location(node=f"n{i}"),
                  "xid-79", Action.NOTIFY, (f"s{i}",)) for i in range(3)]
    a, b, k = (c.add(f) for f in mk)
    c.set_state(b.id, IncidentState.REMEDIATING, T0 + 5, "cordoned")
    assert c.resolve_quiet(T0, T0 + 3600, keep={k.id}) == []
    [done] = c.resolve_quiet(T0 + 3, T0 + 3600, keep={k.id}, quiet_s=3600)
    assert done.id == a.id and done.state is IncidentState.RESOLVED
    assert done.timeline[-1] == TimelineEntry(T0 + 3600, "resolved: quiet for 3600 s")
    assert {i.id for i in c.active()} == {b.id, k.id}
    # The same fault again later opens a new incident: the quiet one is over.
    again = c.add(Finding("x0-again", T0 + 10, FaultClass.GPU_LOST, Severity.ERROR, True, Location(node="n0"),
                          "xid-79", Action.NOTIFY, ("s9",)))
    assert again.id != a.id and again.state is IncidentState.OPEN
