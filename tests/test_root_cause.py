"""Root cause of an error on every rank: hardware, then Flight Recorder, then the hang detector; service and API."""

from __future__ import annotations

import pickle
from pathlib import Path

import httpx
import pytest

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import Action, FaultClass, Incident
from analyzer.rules import Rule
from collector.wire import to_wire
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from sim.traces import Batch, TraceJob

PROGRESS = load_progress_rules([default_progress_rules_dir()])


def replay(an: Analyzer, batches: list[Batch], until: float) -> None:
    batches = sorted(batches, key=lambda b: b[0])
    t, i = batches[0][0], 0
    while t <= until:
        while i < len(batches) and batches[i][0] <= t:
            an.process(batches[i][1])
            i += 1
        an.evaluate(t)
        t += 1.0


def the_incident(an: Analyzer) -> Incident:
    [inc] = an.correlator.incidents()
    return inc


@pytest.fixture
def an(shipped_rules: list[Rule]) -> Analyzer:
    return Analyzer(shipped_rules, correlator=Correlator(), detectors=DetectorSuite(PROGRESS))


def test_silent_hang_then_timeouts_on_every_rank_is_one_incident_naming_the_rank(an: Analyzer) -> None:
    job = TraceJob("llm", world=32, step_s=1.0, seed=1)
    batches = job.run(20)
    t = job.ts
    batches += job.hang_rank(13, behind=True, duration_s=60)
    batches.append(job.nccl_timeouts(t + 600, seq=81, skip=frozenset({13})))
    replay(an, batches, until=t + 605)
    inc = the_incident(an)
    assert inc.fault_class is FaultClass.HANG and not inc.hardware
    assert (inc.root_cause.rank, inc.root_cause.node, inc.root_cause.job) == (13, "llm-n001", "llm")
    # The hang detector named it first; the 31 ranks that reported the timeout (and the one that did not) agree.
    rules = [f.rule_id for f in inc.findings]
    assert rules.count("hang-detector") == 1 and rules.count("timeout-witnesses") == 1 and len(rules) == 2 + 31
    assert inc.recommended_action is Action.RESTART_JOB


def test_timeouts_first_then_the_detector_narrows_the_root_to_a_rank(an: Analyzer) -> None:
    job = TraceJob("llm", world=16, step_s=1.0, seed=2)
    an.process([s for _, sigs in job.run(20) for s in sigs])
    ts, timeouts = job.nccl_timeouts(job.ts + 30, seq=81, skip=frozenset({4}))
    an.process(timeouts)
    first = the_incident(an)
    assert first.root_cause.rank is None and first.root_cause.job == "llm"
    for r, doc in job.flight_recorder_dumps(81, frozenset({4})).items():
        assert an.detectors is not None
        an.detectors.add_flight_recorder_dump("llm", r, job.node_of(r), pickle.dumps(doc), ts)
    an.evaluate(ts + 1)
    inc = the_incident(an)
    assert inc.id == first.id  # same incident, root narrowed
    assert inc.root_finding.rule_id == "flight-recorder" and inc.root_cause.rank == 4
    assert any("narrowed" in t.what for t in inc.timeline)


def test_flight_recorder_outranks_the_hang_detector(an: Analyzer) -> None:
    job = TraceJob("llm", world=16, step_s=1.0, seed=3)
    batches = job.run(20)
    t = job.ts
    batches += job.hang_rank(2, behind=True, duration_s=60)  # progress points at rank 2 ...
    batches.append(job.nccl_timeouts(t + 600, seq=81))
    replay(an, batches, until=t + 602)
    assert an.detectors is not None
    for r, doc in job.flight_recorder_dumps(81, frozenset({9})).items():  # ... the dumps at rank 9
        an.detectors.add_flight_recorder_dump("llm", r, job.node_of(r), pickle.dumps(doc), t + 602)
    an.evaluate(t + 603)
    inc = the_incident(an)
    assert inc.root_finding.rule_id == "flight-recorder" and inc.root_cause.rank == 9


@pytest.mark.parametrize("kernel_lag_s", [0.0, 45.0])
def test_a_hardware_fault_on_a_node_of_the_job_outranks_both(an: Analyzer, kernel_lag_s: float) -> None:
    job = TraceJob("llm", world=32, step_s=1.0, seed=4)
    batches = job.run(20)
    t = job.ts
    ts, xid = job.xid79(t + 0.5, rank=20)
    batches += job.hang_rank(7, behind=True, duration_s=60)
    batches += [(ts + kernel_lag_s, xid), job.nccl_timeouts(t + 600, seq=81)]
    replay(an, batches, until=t + 605)
    inc = the_incident(an)
    assert inc.fault_class is FaultClass.GPU_LOST and inc.hardware
    assert inc.root_cause.node == "llm-n002" and inc.recommended_action is Action.REPLACE_NODE
    assert {f.rule_id for f in inc.findings} == {"xid-79", "hang-detector", "nccl-watchdog-timeout"}


def test_a_bug_on_every_rank_is_the_jobs_application_fault(an: Analyzer) -> None:
    job = TraceJob("llm", world=16, step_s=1.0, seed=5)
    batches = job.run(20)
    batches.append(job.app_error(job.ts + 0.5))
    replay(an, batches, until=job.ts + 60)
    inc = the_incident(an)
    assert inc.fault_class is FaultClass.OOM_GPU and not inc.hardware
    assert inc.root_cause.node is None and inc.root_cause.job == "llm"
    assert inc.recommended_action is Action.FIX_APPLICATION
    assert "hang-detector" in {f.rule_id for f in inc.findings}


def _service(tmp_path: Path) -> Kmend:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", sim_nodes=4)
    k = make_kmend(settings, cluster=build_cluster(4, 8), notifier=LogNotifier())
    k.start()
    return k


def test_service_stores_detector_findings_once_and_rebuilds_them(tmp_path: Path) -> None:
    k = _service(tmp_path)
    job = TraceJob("llm", world=8, step_s=1.0, seed=6)
    for _, sigs in job.run(20) + job.hang_rank(3, behind=True, duration_s=1):
        k.ingest(sigs)
    assert k.evaluate(now=job.ts + 5).findings == ()
    [f] = k.evaluate(now=job.ts + 40).findings
    assert f.where.rank == 3
    assert k.evaluate(now=job.ts + 50).findings == ()
    stored = [x.id for x in k.store.findings_in_order()]
    assert stored == [f.id]
    k.rebuild()
    [inc] = k.incidents()
    assert inc.root_cause.rank == 3 and inc.root_finding.id == f.id
    k.store.close()


def test_detector_clock_follows_backdated_signals(tmp_path: Path) -> None:
    k = _service(tmp_path)
    job = TraceJob("old", world=8, step_s=1.0, seed=7, ts=1_600_000_000.0)  # years ago
    for _, sigs in job.run(20):
        k.ingest(sigs)
    assert k.evaluate().findings == ()  # an old trace is not an old stall
    k.store.close()


def test_flight_recorder_endpoint_accepts_real_dumps_and_refuses_bad_ones(tmp_path: Path) -> None:
    k = _service(tmp_path)
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim")
    fixtures = Path(__file__).parent / "fixtures" / "flight_recorder"
    job = TraceJob("gloo-job", world=3, ranks_per_node=3, step_s=0.1, seed=8)
    with serve_in_thread(create_app(k, settings, run_healer=False)) as url, httpx.Client(base_url=url) as c:
        body = {"signals": [to_wire(s) for _, sigs in job.run(5) for s in sigs]}
        assert c.post("/v1/signals", json=body).status_code == 200
        for r in (0, 2):
            resp = c.post("/v1/flight-recorder", params={"job": "gloo-job", "rank": r, "node": job.node_of(r)},
                          content=(fixtures / f"gloo_trace_rank_{r}").read_bytes())
            assert resp.status_code == 202, resp.text
        bad = c.post("/v1/flight-recorder", params={"job": "gloo-job", "rank": 1, "node": "n"},
                     content=pickle.dumps({"entries": [Path("/etc/passwd")]}))
        assert bad.status_code == 400 and "refused" in bad.json()["detail"]
    found = k.evaluate(now=k.detector_now() + 30).findings
    [f] = [x for x in found if x.rule_id == "flight-recorder"]
    assert f.where.rank == 1 and f.where.node == job.node_of(1)
    assert f.fields["silent_ranks"] == "1"
    k.store.close()
