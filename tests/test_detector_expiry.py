"""Detector state expires with its job: a job silent past the limit leaves nothing behind in any detector,
and a job name used again later is judged afresh (its old reports do not silence the new run)."""

from __future__ import annotations

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.detectors.witnesses import DETECTOR_ID as WITNESSES
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import Finding
from analyzer.rules import Rule
from sim.traces import Batch, TraceJob

PROGRESS = load_progress_rules([default_progress_rules_dir()])


def _replay(an: Analyzer, batches: list[Batch], until: float) -> list[Finding]:
    batches = sorted(batches, key=lambda b: b[0])
    found: list[Finding] = []
    t, i = batches[0][0], 0
    while t <= until:
        while i < len(batches) and batches[i][0] <= t:
            found += an.process(batches[i][1])[0]
            i += 1
        found += an.evaluate(t)[0]
        t += 1.0
    return found


def _stuck_run(an: Analyzer, start: float) -> list[Finding]:
    """Twenty healthy steps, then every rank but 5 reports an NCCL timeout: rank 5 is what they waited for."""
    job = TraceJob("llm", world=16, step_s=1.0, seed=3, ts=start)
    batches = job.run(20)
    t = job.ts
    batches.append(job.nccl_timeouts(t + 600, seq=81, skip=frozenset({5})))
    return [f for f in _replay(an, batches, until=t + 610) if f.rule_id == WITNESSES]


def test_a_job_silent_past_the_limit_leaves_no_state_and_its_name_is_judged_afresh(shipped_rules: list[Rule]) -> None:
    suite = DetectorSuite(PROGRESS, forget_after_s=3600)
    an = Analyzer(shipped_rules, correlator=Correlator(), detectors=suite)
    t0 = 1_700_000_000.0
    [first] = _stuck_run(an, t0)
    assert first.where.rank == 5

    an.evaluate(t0 + 2 * 86400)  # a day and more of silence
    assert "llm" not in suite.book.jobs
    kept = [suite.hang._reported, suite.witnesses._open, suite.stacks._stacks, suite.stacks._last,
            suite.flight_recorder._reported, suite.straggler._last_step]
    assert all("llm" not in k for k in kept)
    assert not [k for k in suite.witnesses._reported if k[0] == "llm"]
    assert not [k for k in (*suite.straggler._ranks, *suite.straggler._nodes, *suite.straggler._lags)
                if k[0] == "llm"]
    assert not [k for k in (*suite.extractor._counters, *suite.extractor._epochs) if k[0] == "llm"]

    # The same job name a week later, stuck the same way: reported again (it used to be taken for the old one).
    [again] = _stuck_run(an, t0 + 7 * 86400)
    assert again.where.rank == 5 and again.id != first.id
