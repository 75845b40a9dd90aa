"""A node agent that starts after a job's pods ended: the ranks read from an ended pod's log are told exited (so the
job's old step lines are no hang), only for pods with no process on the node, logs unchanged since the agent
started, and a ``/proc`` that is the host's; a job whose processes are still there is judged as before, and a rank
heard of after the others exited reopens its job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass, Finding
from analyzer.rules import default_rules_dir, load_rules
from collector.processes import ProcessFinder, host_view
from collector.progress_summary import SummarisedProgress
from collector.signal import ProgressSample, Signal, Source
from kmend.commands.agent import AgentSettings, build_agent

T0 = time.time() - 7200.0
"""When the job ran (the agent starts long after)."""
UIDS = ("a1111111-2222-3333-4444-555555555555", "b1111111-2222-3333-4444-555555555555",
        "c1111111-2222-3333-4444-555555555555")


def _write_log(root: Path, pod: str, uid: str, steps: range, *, age_s: float = 60.0) -> Path:
    """A pod's CRI log of step lines, last written `age_s` ago."""
    path = root / f"train_{pod}_{uid}" / "trainer" / "0.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for s in steps:
            ts = datetime.fromtimestamp(T0 + 0.5 * s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            fh.write(f"{ts} stdout F step {s} loss 0.1\n")
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _settings(tmp: Path, **kw: object) -> AgentSettings:
    return AgentSettings(node="node-0", state_dir=tmp / "state", pods_root=tmp / "pods", kernel="off", nvml=False,
                         pod_labels=False, ib_root=tmp / "no-ib", service_url="http://127.0.0.1:9", **kw)  # type: ignore[arg-type]


def _poll(settings: AgentSettings, polls: int = 4, between: object = None) -> list[Signal]:
    """What the agent's sources hand on over a few polls (in the agent's order), as the service would get it."""
    agent = build_agent(settings)
    out: list[Signal] = []
    for i in range(polls):
        if callable(between):
            between(i)
        for src in agent.sources:
            out.extend(src.poll().signals)
    for src in agent.sources:
        if isinstance(src, SummarisedProgress):
            out.extend(src.windows.flush(time.time()))  # the summaries falling due
        src.close()
    return out


def _exits(signals: list[Signal]) -> list[tuple[str, int]]:
    return sorted((s.payload.job, s.payload.rank) for s in signals
                  if isinstance(s.payload, ProgressSample) and s.payload.event == "exit")


def _hangs(signals: list[Signal]) -> list[Finding]:
    """Hang findings when the signals arrive now (long after the job's steps) and a minute passes."""
    an = Analyzer(load_rules([default_rules_dir()]), correlator=Correlator(),
                  detectors=DetectorSuite(load_progress_rules([default_progress_rules_dir()])))
    now = max(s.ts for s in signals)
    found = an.process(signals)[0]
    for k in range(60):
        found += an.evaluate(now + k)[0]
    return [f for f in found if f.fault_class is FaultClass.HANG]


@pytest.fixture
def pod_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process of pod ``held-worker-1`` (its HOSTNAME), still on the node. (A name no other test's pod has: the
    agent looks at every process on the host, tests running beside this one included.)"""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         env={**os.environ, "HOSTNAME": "held-worker-1"})
    yield p
    p.kill()
    p.wait()


needs_host = pytest.mark.skipif(not host_view(Path("/proc")), reason="this /proc is not the host's")


@needs_host
@pytest.mark.parametrize("steps", [40, 8000], ids=["short-log", "log-read-over-several-polls"])
def test_pods_that_ended_before_the_agent_started_have_their_ranks_exit_and_raise_no_hang(
        tmp_path: Path, steps: int) -> None:
    for r in range(2):
        _write_log(tmp_path / "pods", f"late-worker-{r}", UIDS[r], range(1, steps + 1))
    signals = _poll(_settings(tmp_path))
    assert _exits(signals) == [("late", 0), ("late", 1)]
    # Each rank's exit follows its steps (the service keeps no exit of a rank it has not seen).
    kinds = [(s.payload.rank, s.payload.event) for s in signals if isinstance(s.payload, ProgressSample)]
    assert all(kinds.index((r, "step")) < kinds.index((r, "exit")) for r in range(2)), kinds
    assert _hangs(signals) == []
    # The same lines without the exits: the job that simply finished looks stalled.
    assert _hangs([s for s in signals if not (isinstance(s.payload, ProgressSample) and s.payload.event == "exit")])


@needs_host
def test_a_pod_whose_process_is_still_there_is_not_told_and_its_job_is_a_hang(
        tmp_path: Path, pod_process: subprocess.Popen[bytes]) -> None:
    # Rank 1's process is still on the node (stopped or blocked: its log says nothing new): the job is stuck.
    for r in range(2):
        _write_log(tmp_path / "pods", f"held-worker-{r}", UIDS[r], range(1, 41))
    finder = ProcessFinder(pods_root=tmp_path / "pods")
    deadline = time.monotonic() + 30
    while "held-worker-1" not in finder.occupancy().hostnames:  # until it has exec'd
        assert pod_process.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    signals = _poll(_settings(tmp_path))
    assert _exits(signals) == [("held", 0)]
    [hang] = _hangs(signals)
    assert hang.where.job == "held"


@needs_host
def test_a_log_written_since_the_agent_started_is_not_told(tmp_path: Path) -> None:
    # Rank 0's log was written just before the agent started and is written on after (its processes are the
    # agent's to see); rank 2's was written just before and stays as it was; rank 1's pod ended a minute ago.
    # "Just before": stamped a few seconds ahead, so that it is still recent at the agent's first look however
    # long the agent takes to start on a loaded machine.
    for r, age in ((0, -5.0), (1, 60.0), (2, -5.0)):
        _write_log(tmp_path / "pods", f"late-worker-{r}", UIDS[r], range(1, 41), age_s=age)

    def grow(i: int) -> None:
        if i == 1:
            _write_log(tmp_path / "pods", "late-worker-0", UIDS[0], range(41, 43), age_s=0.0)
        if i:
            time.sleep(1.1)  # the process source's next look

    signals = _poll(_settings(tmp_path), polls=3, between=grow)
    assert _exits(signals) == [("late", 1), ("late", 2)]


def test_a_proc_that_is_not_the_hosts_tells_nothing(tmp_path: Path) -> None:
    # A container without host PID access sees only its own processes: an absence there says nothing.
    own = tmp_path / "proc"
    (own / "1").mkdir(parents=True)
    (own / "1" / "stat").write_text("1 (kmend) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 25 0 0\n")
    assert not host_view(own)
    for r in range(2):
        _write_log(tmp_path / "pods", f"late-worker-{r}", UIDS[r], range(1, 41))
    assert _exits(_poll(_settings(tmp_path, proc_root=own))) == []


def test_a_rank_heard_of_after_the_others_exited_reopens_the_job() -> None:
    # Node 1's agent came up first and told its rank exited; node 2's agent reads its rank's steps later, and that
    # rank's process is still there (stuck): the job is not over until it exits too.
    suite = DetectorSuite(load_progress_rules([default_progress_rules_dir()]))
    steps = [Signal(f"n1/progress/{s}", "n1", Source.PROGRESS, T0 + s, ProgressSample("ddp", 0, s, 1.0))
             for s in range(1, 41)]
    now = T0 + 3600
    suite.observe([*steps, Signal("n1/exit", "n1", Source.PROGRESS, now, ProgressSample("ddp", 0, 0, event="exit"))])
    assert suite.book.jobs["ddp"].finished
    suite.observe([Signal(f"n2/progress/{s}", "n2", Source.PROGRESS, T0 + s, ProgressSample("ddp", 1, s, 1.0))
                   for s in range(1, 41)])
    [hang] = [f for f in suite.evaluate(now + 1) if f.fault_class is FaultClass.HANG]
    assert hang.where.job == "ddp"
    suite.observe([Signal("n2/exit", "n2", Source.PROGRESS, now + 2, ProgressSample("ddp", 1, 0, event="exit"))])
    assert suite.book.jobs["ddp"].finished


@needs_host
def test_a_zombie_on_the_node_leaves_the_view_complete(tmp_path: Path) -> None:
    # Nodes often carry a defunct process nobody reaped: it runs nothing, and its environment cannot be read.
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ProcessFinder(pods_root=tmp_path / "pods").occupancy().complete
    finally:
        os.waitpid(pid, 0)
