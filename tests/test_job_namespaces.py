"""Job identity across namespaces: ``train`` in two namespaces is two jobs, from the agent to the healer."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass, Finding
from analyzer.rules import Rule, default_rules_dir, load_rules
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.wire import SignalBatch, SignalIn, to_record, to_wire
from kmend.api.signal_decode import decode_fast
from kmend.cli import build_parser
from kmend.commands.agent import AgentSettings, build_agent
from tests.agent_helpers import spooled
from tests.builders import kernel, nccl_timeout
from tests.conftest import free_port
from tests.healing import Harness, incident

PROGRESS = load_progress_rules([default_progress_rules_dir()])
RULES = load_rules([default_rules_dir()])
T0 = 1_800_000_000.0
UID = "8d7c6b5a-0000-1111-2222-"


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


def _write_pods(pods_root: Path, *, stuck_ns: str, stop_at: int, last: int) -> None:
    """Job ``train`` (two ranks, one pod each) in namespaces ``a`` and ``b``; `stuck_ns` stops at `stop_at`."""
    for ns in ("a", "b"):
        for rank in range(2):
            d = pods_root / f"{ns}_train-worker-{rank}_{UID}{ns}{rank:011d}" / "trainer"
            d.mkdir(parents=True)
            end = stop_at if ns == stuck_ns else last
            (d / "0.log").write_text("".join(
                f"{_stamp(T0 + s + 0.01 * rank)} stdout F [rank{rank}]: step {s} loss 0.5\n"
                for s in range(1, end + 1)))


def _analyze(signals: list[Signal], until: float) -> list[Finding]:
    """The signals through the analyzer in time order, evaluated once a second as the service does."""
    an = Analyzer(RULES, correlator=Correlator(), detectors=DetectorSuite(PROGRESS))
    signals = sorted(signals, key=lambda s: s.ts)
    out: list[Finding] = []
    t, i = signals[0].ts, 0
    while t <= until:
        j = i
        while j < len(signals) and signals[j].ts <= t:
            j += 1
        if j > i:
            out += an.process(signals[i:j])[0]
            i = j
        out += an.evaluate(t)[0]
        t += 1.0
    return out



def test_a_hang_in_one_namespace_is_found_while_the_same_job_name_runs_on_in_another(tmp_path: Path) -> None:
    _write_pods(tmp_path / "pods", stuck_ns="a", stop_at=40, last=100)
    # A port nobody listens on: every batch lands in the spool, as the service would receive it. Every line, as
    # an agent that does not summarise step lines ships them (summaries: tests/test_progress_lines_edge.py).
    settings = AgentSettings(node="gpu-1", state_dir=tmp_path / "state", pods_root=tmp_path / "pods", kernel="off",
                             ib_root=tmp_path / "no-ib", nvml=False, pod_labels=False, progress_summary_s=0,
                             service_url=f"http://127.0.0.1:{free_port()}")
    agent = build_agent(settings)
    agent.run_once()
    agent.flush()
    agent.flush()
    wire = spooled(settings.state_dir)
    assert len(wire) == 2 * 40 + 2 * 100
    signals = [to_record(SignalBatch.model_validate({"signals": [s]}).signals[0]) for s in wire]
    found = [f for f in _analyze(signals, until=T0 + 100) if f.fault_class is FaultClass.HANG]
    assert found, "the stalled job in namespace a was not seen: its name's steps in namespace b hid it"
    assert {(f.where.namespace, f.where.job) for f in found} == {("a", "train")}
    assert "job a/train" in found[0].message
    assert found[0].ts - (T0 + 40) <= 20.0


def test_kmend_analyze_tells_the_two_jobs_apart_in_a_bundle(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _write_pods(tmp_path / "bundle" / "gpu-1" / "var" / "log" / "pods", stuck_ns="b", stop_at=30, last=90)
    args = build_parser().parse_args(["analyze", str(tmp_path / "bundle"), "--format", "json"])
    assert args.func(args) == 4
    out = json.loads(capsys.readouterr().out)
    hangs = [i for i in out["incidents"] if i["fault_class"] == "hang"]
    assert [(i["root_cause"]["namespace"], i["root_cause"]["job"]) for i in hangs] == [("b", "train")]

    args = build_parser().parse_args(["analyze", str(tmp_path / "bundle")])
    args.func(args)
    assert "b/train" in capsys.readouterr().out


def _progress(namespace: str | None) -> dict[str, Any]:
    sig = Signal("n1/progress/1", "n1", Source.PROGRESS, T0, ProgressSample("train", 3, 7, 0.5, namespace=namespace))
    return to_wire(sig)


def test_the_wire_carries_the_namespace_and_accepts_older_agents_without_it() -> None:
    for ns in ("a", None):
        body = _progress(ns)
        assert ("namespace" in body["payload"]) is (ns is not None)
        slow = to_record(SignalIn.model_validate(body))
        fast = decode_fast(json.dumps({"signals": [body]}).encode())
        assert fast is not None
        for sig in (slow, fast[0][0]):
            assert isinstance(sig.payload, ProgressSample)
            assert (sig.payload.job, sig.payload.namespace) == ("train", ns)
    bad = _progress("a")
    bad["payload"]["namespace"] = "a/b"
    with pytest.raises(ValidationError, match="namespace"):
        SignalIn.model_validate(bad)


def test_the_healer_acts_on_the_namespace_the_incident_names(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, job_nodes=4)  # "llama" in namespace "training" on gpu-node-00..03
    h.workloads.add_pod("z-team", "llama-worker-0", node="gpu-node-09", labels={
        "training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-index": "0"})
    line = LogLine(nccl_timeout(0), namespace="z-team", pod="llama-worker-0", container="trainer", job="llama",
                   rank=0)
    inc = incident(shipped_rules, [Signal("gpu-node-09/container/1", "gpu-node-09", Source.CONTAINER, T0, line)])
    assert (inc.root_cause.namespace, inc.root_cause.job, inc.hardware) == ("z-team", "llama", False)
    [plan] = h.healing().heal_once([inc], lambda *_: None)
    assert plan.namespace == "z-team"
    assert {s.params["namespace"] for s in plan.steps if s.params.get("job")} <= {"z-team"}


def test_kmend_get_names_the_job_with_its_namespace() -> None:
    from kmend.commands.ctl import COLUMNS, table

    _, cols, wide = COLUMNS["incidents"]
    row = {"id": "inc-1", "state": "open", "fault_class": "hang", "hardware": False,
           "recommended_action": "restart_job", "opened_at": T0, "jobs": ["b/train"],
           "root_cause": {"node": "gpu-1", "gpu": None, "pci": None, "port": None, "rank": 3, "job": "train",
                          "namespace": "b"}}
    out = table([row], [*cols, *wide], T0 + 60)
    assert "job=b/train" in out and "rank=3" in out
    _, plan_cols, plan_wide = COLUMNS["plans"]
    plan = {"id": "plan-1", "state": "pending", "mode": "approval", "policy": "p", "node": "gpu-1", "steps": [],
            "created_at": T0, "incident_id": "inc-1", "job": "train", "namespace": "b"}
    assert "b/train" in table([plan], [*plan_cols, *plan_wide], T0 + 60)


def _same_job_two_reporters(stuck_rank: int, stop_at: int, last: int) -> list[Signal]:
    """Job ``train`` in namespace ``team-a`` on gpu-1 and gpu-2 (one rank each), seen twice: the hook's samples,
    written by a reporter that knows no namespace, land a moment before the agent's namespaced log lines of the
    same steps. It hangs: `stuck_rank` stops at `stop_at`, the other a step later. ``train`` also runs, healthy,
    in namespace ``team-b`` on gpu-3 and gpu-4, up to `last`."""
    out: list[Signal] = []
    for rank in range(2):
        node = f"gpu-{rank + 1}"
        end = stop_at if rank == stuck_rank else stop_at + 1
        for s in range(1, end + 1):
            ts = T0 + s + 0.01 * rank
            out.append(Signal(f"{node}/progress/{s}", node, Source.PROGRESS, ts - 0.005,
                              ProgressSample("train", rank, s, 1.0)))
            out.append(Signal(f"{node}/container/{s}", node, Source.CONTAINER, ts,
                              LogLine(f"[rank{rank}]: step {s} loss 0.5", namespace="team-a",
                                      pod=f"train-worker-{rank}", container="trainer", job="train", rank=rank)))
    for rank in range(2):
        node = f"gpu-{rank + 3}"
        out += [Signal(f"{node}/container/{s}", node, Source.CONTAINER, T0 + s + 0.01 * rank,
                       LogLine(f"[rank{rank}]: step {s} loss 0.5", namespace="team-b", pod=f"train-worker-{rank}",
                               container="trainer", job="train", rank=rank)) for s in range(1, last + 1)]
    return out


def test_a_bare_named_reporter_of_the_same_ranks_is_the_namespaced_job() -> None:
    an = Analyzer(RULES, correlator=Correlator(), detectors=DetectorSuite(PROGRESS))
    found = _replay(an, _same_job_two_reporters(stuck_rank=1, stop_at=40, last=100), until=T0 + 100)
    hangs = [f for f in found if f.fault_class is FaultClass.HANG]
    # One job, named with its namespace: not a bare "train" that team-b's steps keep alive, nor a second job.
    assert {(f.where.namespace, f.where.job, f.where.rank) for f in hangs} == {("team-a", "train", 1)}
    assert {j for inc in an.correlator.incidents() for j in inc.jobs} == {"team-a/train"}


def test_a_fault_on_a_node_of_a_job_seen_under_two_names_belongs_to_that_job() -> None:
    signals = _same_job_two_reporters(stuck_rank=1, stop_at=100, last=100)
    signals.append(kernel("gpu-2", "[ 8123.450001] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.",
                          ts=T0 + 41))
    an = Analyzer(RULES, correlator=Correlator(), detectors=DetectorSuite(PROGRESS))
    _replay(an, signals, until=T0 + 100)
    # The hook's bare "train" and the agent's "team-a/train" on gpu-2 are one job, so the Xid is that job's.
    [xid] = an.correlator.incidents()
    assert (xid.root_cause.namespace, xid.root_cause.job) == ("team-a", "train") and xid.hardware


def _replay(an: Analyzer, signals: list[Signal], until: float) -> list[Finding]:
    signals = sorted(signals, key=lambda s: s.ts)
    found: list[Finding] = []
    t, i = signals[0].ts, 0
    while t <= until:
        j = i
        while j < len(signals) and signals[j].ts <= t:
            j += 1
        found += an.process(signals[i:j])[0] + an.evaluate(t)[0]
        i, t = j, t + 1.0
    return found


def test_kmend_analyze_takes_a_bare_named_log_of_the_same_ranks_as_the_namespaced_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The trainer's own log file (no namespace: its job comes from --job) beside its pods' CRI logs.
    node = tmp_path / "bundle" / "gpu-1"
    own = []
    for rank in range(2):
        d = node / "var" / "log" / "pods" / f"team-a_train-worker-{rank}_{UID}{rank:012d}" / "trainer"
        d.mkdir(parents=True)
        end = 30 if rank == 1 else 31
        (d / "0.log").write_text("".join(
            f"{_stamp(T0 + s + 0.01 * rank)} stdout F [rank{rank}]: step {s} loss 0.5\n" for s in range(1, end + 1)))
        own += [(T0 + s + 0.01 * rank - 0.005, f"[rank{rank}]: step {s} loss 0.5") for s in range(1, end + 1)]
    (node / "train.log").write_text("".join(f"{_stamp(ts)} {text}\n" for ts, text in sorted(own)))
    (node / "kern.log").write_text(f"{_stamp(T0 + 120)} gpu-1 kernel: [ 9000.000000] nothing to see\n")
    args = build_parser().parse_args(["analyze", str(tmp_path / "bundle"), "--job", "train", "--format", "json"])
    args.func(args)
    out = json.loads(capsys.readouterr().out)
    hangs = [i for i in out["incidents"] if i["fault_class"] == "hang"]
    assert [(i["root_cause"]["namespace"], i["root_cause"]["job"], i["root_cause"]["rank"]) for i in hangs] == [
        ("team-a", "train", 1)]
    named = {(f["namespace"], f["job"]) for i in out["incidents"] for f in i["findings"]}
    assert named <= {("team-a", "train"), (None, None)}


def _hook_and_rule_lines(tmp_path: Path, line_after_s: float) -> list[Any]:
    """Job ``train`` in namespace ``team-a``, one rank on each of gpu-1 and gpu-2: its progress comes only from a
    reporter that knows no namespace (the hook outside the pods' view); the node agents ship only rule lines, with
    the pods' identity. Rank 1 stops at step 40; `line_after_s` later rank 0's watchdog prints its timeout. The
    service's incidents, as `kmend serve` holds them."""
    from healer.notify import LogNotifier
    from kmend.settings import Settings
    from kmend.wiring import make_kmend
    from sim.cluster import build_cluster

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", dry_run=True)
    kmend = make_kmend(settings, cluster=build_cluster(2, 8), notifier=LogNotifier())
    kmend.start()
    try:
        t = T0
        for s in range(1, 42):
            t = T0 + s
            kmend.ingest([Signal(f"gpu-{r + 1}/progress/{s}", f"gpu-{r + 1}", Source.PROGRESS, t + 0.01 * r,
                                 ProgressSample("train", r, s, 1.0)) for r in range(2) if s <= 40 + (r == 0)])
            kmend.evaluate(now=t + 0.5)
        line = LogLine(nccl_timeout(0), namespace="team-a", pod="train-worker-0", container="trainer", job="train",
                       rank=0)
        for k in range(1, 60):
            if k == int(line_after_s):
                kmend.ingest([Signal("gpu-1/container/team-a_train-worker-0/1", "gpu-1", Source.CONTAINER,
                                     t + line_after_s, line)])
            kmend.evaluate(now=t + k)
        return [(i.fault_class.value, i.root_cause.namespace, i.root_cause.job, i.root_cause.rank, i.jobs)
                for i in kmend.incidents()]
    finally:
        kmend.store.close()


def test_a_job_reported_bare_takes_the_namespace_its_nodes_rule_lines_give_it(tmp_path: Path) -> None:
    # The watchdog's line comes before the hang is called: the hang is the namespaced job's, and the line joins it.
    incs = _hook_and_rule_lines(tmp_path, line_after_s=5.0)
    assert [i[1:4] for i in incs if i[0] == "hang"] == [("team-a", "train", 1)], incs
    assert {j for i in incs for j in i[4]} == {"team-a/train"}, incs


def test_a_stall_called_under_the_bare_name_is_not_called_again_under_the_namespaced_one(tmp_path: Path) -> None:
    # The line comes after the hang was called under the bare name: one stall, one incident, which the line joins
    # (and the ranks' complaints, naming rank 1, name its namespace).
    incs = _hook_and_rule_lines(tmp_path, line_after_s=30.0)
    assert [i[:4] for i in incs] == [("hang", "team-a", "train", 1)], incs


def test_a_bare_reporter_takes_no_namespace_where_two_namespaces_run_the_job_on_its_node() -> None:
    from analyzer.detectors.book import JobBook

    book = JobBook()
    for ns in ("a", "b"):
        book.observe_pod_job("gpu-1", ns, "train", T0)
    book.observe_pod_job("gpu-2", "a", "train", T0)
    assert book.key_for(None, "train", node="gpu-1") == "train"
    assert book.key_for(None, "train", node="gpu-2") == "a/train"
