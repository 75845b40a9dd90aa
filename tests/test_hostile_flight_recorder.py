"""Hostile Flight Recorder uploads: refused at the edge naming the field; detectors (and the jobs in them)
isolated; analysis once."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from analyzer.detectors import flight_recorder as fr
from analyzer.detectors.flight_recorder import DumpError, load_dump
from analyzer.detectors.suite import DetectorSuite
from sim.traces import TraceJob
from tests.builders import XID79, kernel
from tests.hostile import Served, serve, wait_for


def _dumps(job: str, missing: int, world: int = 4) -> tuple[TraceJob, dict[int, dict[str, Any]]]:
    tj = TraceJob(job, world=world, seed=3)
    return tj, tj.flight_recorder_dumps(seq=40, missing=frozenset({missing}))


def _upload(s: Served, job: str, rank: int, node: str, body: bytes) -> Any:
    return s.client.post("/v1/flight-recorder", params={"job": job, "rank": rank, "node": node}, content=body)


def _fr_incident(s: Served, job: str) -> dict[str, Any] | None:
    return next((i for i in s.incidents() if i["fault_class"] == "hang" and job in i["jobs"]), None)


def test_a_dump_with_a_text_sequence_id_is_refused_naming_the_field_and_others_are_still_judged(
        tmp_path: Path) -> None:
    with serve(tmp_path, flight_recorder_settle_s=0.2) as s:
        assert s.post([kernel("gpu-node-01", XID79, ts=time.time())]).status_code == 200  # before
        _, bad = _dumps("poison", missing=1)
        bad[0]["entries"][0]["collective_seq_id"] = "abc"
        r = _upload(s, "poison", 0, "gpu-node-02", pickle.dumps(bad[0]))
        assert r.status_code == 400, r.text
        assert "entries[0].collective_seq_id" in r.json()["detail"]
        tj, good = _dumps("good", missing=2)  # after: a real stuck job is still judged
        for rank, doc in good.items():
            assert _upload(s, "good", rank, tj.node_of(rank), pickle.dumps(doc)).status_code == 202
        inc = wait_for(lambda: _fr_incident(s, "good"))
        assert inc["root_cause"]["rank"] == 2
        assert s.post([kernel("gpu-node-05", XID79, ts=time.time())]).status_code == 200
        wait_for(lambda: any(i["root_cause"]["node"] == "gpu-node-05" for i in s.incidents()))


def test_a_failing_detector_is_counted_and_the_others_still_report(tmp_path: Path) -> None:
    with serve(tmp_path, flight_recorder_settle_s=0.2) as s:
        def broken(now: float) -> list[Any]:
            raise RuntimeError("straggler state corrupt")

        s.kmend.detectors.straggler.evaluate = broken  # type: ignore[method-assign]
        tj, good = _dumps("good", missing=3)
        for rank, doc in good.items():
            assert _upload(s, "good", rank, tj.node_of(rank), pickle.dumps(doc)).status_code == 202
        assert wait_for(lambda: _fr_incident(s, "good"))["root_cause"]["rank"] == 3
        metrics = s.client.get("/metrics").text
        assert 'kmend_analyzer_detector_errors_total{detector="straggler"}' in metrics


def test_one_jobs_dumps_that_break_the_analysis_do_not_stop_another_jobs_verdict(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = fr.analyze

    def analyze(dumps: Any) -> Any:
        dumps = list(dumps)
        if any(d.node == "bad-node" for d in dumps):
            raise ValueError("unexpected shape")  # stands for any bug one job's data could hit
        return real(dumps)

    monkeypatch.setattr(fr, "analyze", analyze)
    suite = DetectorSuite(flight_recorder_settle_s=1.0)
    for job, node in (("bad", "bad-node"), ("good", None)):
        tj, docs = _dumps(job, missing=1)
        for rank, doc in docs.items():
            suite.add_flight_recorder_dump(job, rank, node or tj.node_of(rank), pickle.dumps(doc), ts=10.0)
    found = suite.evaluate(20.0)
    assert [(f.where.job, f.where.rank) for f in found] == [("good", 1)]
    assert [(f.detector, f.job) for f in suite.take_failures()] == [("flight-recorder", "bad")]
    assert suite.evaluate(30.0) == [] and suite.take_failures() == []  # the bad job was dropped, not retried


@pytest.mark.parametrize(("field", "value"), [
    ("collective_seq_id", "abc"), ("collective_seq_id", 1.5), ("collective_seq_id", -3),
    ("process_group", 7), ("state", ["completed"]), ("retired", "yes"), ("profiling_name", b"x" * 10),
])
def test_every_field_the_analysis_reads_is_checked(field: str, value: Any) -> None:
    _, docs = _dumps("j", missing=1)
    docs[0]["entries"][5][field] = value
    with pytest.raises(DumpError, match=rf"entries\[5\]\.{field}"):
        load_dump(pickle.dumps(docs[0]))


def test_group_ranks_are_read_as_digits_never_evaluated() -> None:
    _, docs = _dumps("j", missing=1)
    docs[0]["pg_config"]["0"]["ranks"] = "[0, 1, __import__('os').getpid()]"
    with pytest.raises(DumpError, match=r"pg_config\['0'\]\.ranks"):
        load_dump(pickle.dumps(docs[0]))
    docs[0]["pg_config"]["0"]["ranks"] = "[" * 100_000
    with pytest.raises(DumpError, match="ranks"):
        load_dump(pickle.dumps(docs[0]))


def test_a_dump_of_millions_of_references_to_one_entry_is_refused_quickly() -> None:
    _, docs = _dumps("j", missing=1)
    bomb = dict(docs[0], entries=[docs[0]["entries"][0]] * 4_000_000)
    data = pickle.dumps(bomb, protocol=4)
    assert len(data) < 16 * 1024 * 1024
    t = time.perf_counter()
    with pytest.raises(DumpError, match="entries: 4000000 entries"):
        load_dump(data)
    assert time.perf_counter() - t < 5.0


def test_dumps_are_analysed_once_when_settled_not_on_every_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = fr.analyze
    monkeypatch.setattr(fr, "analyze", lambda dumps: calls.append(1) or real(dumps))
    suite = DetectorSuite(flight_recorder_settle_s=10.0)
    tj, docs = _dumps("j", missing=1)
    for rank in (0, 2, 3):  # rank 1 is the culprit and wrote nothing: the job waits to settle
        suite.add_flight_recorder_dump("j", rank, tj.node_of(rank), pickle.dumps(docs[rank]), ts=100.0)
    for tick in range(9):
        assert suite.evaluate(100.0 + tick) == []
    assert calls == []
    [f] = suite.evaluate(111.0)
    assert f.where.rank == 1 and len(calls) == 1


def test_one_jobs_data_that_breaks_the_straggler_scoring_does_not_stop_another_jobs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from analyzer.detectors.straggler import StragglerDetector
    from sim.traces import Straggle

    real = StragglerDetector._score_ranks

    def score(self: StragglerDetector, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "training/bad":  # the job key: namespace/job
            raise FloatingPointError("impossible step times")  # stands for any bug one job's data could hit
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(StragglerDetector, "_score_ranks", score)
    suite = DetectorSuite()
    good, bad = TraceJob("good", world=32, step_s=1.0, seed=8), TraceJob("bad", world=32, step_s=1.0, seed=9)
    found = []
    slow = Straggle(rank=7, factor=1.5, from_step=11)
    for (t, sigs), (_, bad_sigs) in zip(good.run(10) + good.run(30, straggle=slow), bad.run(40), strict=True):
        suite.observe(sigs + bad_sigs)
        found.extend(suite.evaluate(t))
    assert {(f.where.job, f.where.rank) for f in found if f.fault_class.value == "straggler"} == {("good", 7)}
    assert {(f.detector, f.job) for f in suite.take_failures()} == {("straggler", "training/bad")}
