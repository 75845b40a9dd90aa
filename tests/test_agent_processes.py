"""Training processes seen through the host's /proc: which pod and job a rank process belongs to off-cluster,
its stopped state (and py-spy on a stopped process), and the end of a job's processes as the end of the job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass
from analyzer.rules import default_rules_dir, load_rules
from collector.processes import ProcessFinder, TrainingProcess
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.sources.procs import ProcessExitSource
from collector.stacks import PySpyDumper, StackRequestResponder
from healer.notify import LogNotifier
from healer.steps.base import RepairRequest
from kmend.app import create_app
from kmend.commands.agent import _py_spy
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

LOOP = "import time\ndef train_step():\n    time.sleep(0.05)\nwhile True:\n    train_step()\n"

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start rank processes as a launcher would (RANK, WORLD_SIZE, the pod's HOSTNAME); all killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(rank: int, pod: str, **extra: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "HOSTNAME": pod,
               "TORCHELASTIC_RUN_ID": "none", **extra}
        p = subprocess.Popen([sys.executable, "-c", LOOP], env=env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _pod_dir(root: Path, ns: str, pod: str, uid: str) -> None:
    (root / f"{ns}_{pod}_{uid}" / "trainer").mkdir(parents=True)


def _mine(finder: ProcessFinder, pids: set[int], wait_s: float = 10.0) -> list[TrainingProcess]:
    """The finder's view of these processes, once each has exec'd (its environment readable)."""
    deadline = time.monotonic() + wait_s
    while True:
        got = [p for p in finder.find() if p.pid in pids]
        if len(got) == len(pids) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_a_rank_process_belongs_to_the_job_of_its_pod_off_cluster(tmp_path: Path, spawn: Spawn) -> None:
    # torchrun without --rdzv-id names every job "none"; the pod it runs in names the job.
    _pod_dir(tmp_path, "train", "llama-worker-1", "11111111-2222-3333-4444-555555555555")
    p = spawn(1, "llama-worker-1")
    [proc] = _mine(ProcessFinder(pods_root=tmp_path), {p.pid})
    assert (proc.job, proc.rank, proc.pod, proc.names) == ("llama", 1, "train/llama-worker-1", ("llama",))


def test_a_pod_name_that_two_namespaces_share_is_no_pod_to_go_by(tmp_path: Path, spawn: Spawn) -> None:
    _pod_dir(tmp_path, "team-a", "bert-worker-0", "11111111-2222-3333-4444-555555555555")
    _pod_dir(tmp_path, "team-b", "bert-worker-0", "66666666-2222-3333-4444-555555555555")
    p = spawn(0, "bert-worker-0", KMEND_JOB="bert-b")
    [proc] = _mine(ProcessFinder(pods_root=tmp_path), {p.pid})
    assert (proc.pod, proc.names) == (None, ("bert-b",))


def test_a_pod_name_reused_in_its_namespace_is_the_pod_whose_log_is_written(tmp_path: Path, spawn: Spawn) -> None:
    # A job run again under the same pod names: the finished run's pod directory stays beside the new one, and
    # the process (whose HOSTNAME names both) runs in the pod whose log is being written.
    old, new = "11111111-2222-3333-4444-555555555555", "66666666-7777-8888-9999-000000000000"
    for uid, mtime in ((old, 1_000_000), (new, 2_000_000)):
        _pod_dir(tmp_path, "train", "llama-worker-1", uid)
        log = tmp_path / f"train_llama-worker-1_{uid}" / "trainer" / "0.log"
        log.write_text("step 1\n")
        os.utime(log, (mtime, mtime))
    p = spawn(1, "llama-worker-1")
    [proc] = _mine(ProcessFinder(pods_root=tmp_path), {p.pid})
    assert (proc.job, proc.rank, proc.pod) == ("llama", 1, "train/llama-worker-1")


LAUNCHER = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(1.0)  # a launcher's child between fork and exec: the launcher's environment and command name
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", HOSTNAME="llama-worker-1")
    os.execve(sys.executable, [sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"], env)
print(child, flush=True)
os.waitpid(child, 0)
"""


def test_a_rank_first_seen_between_its_launchers_fork_and_exec_is_found_after_the_exec(tmp_path: Path) -> None:
    _pod_dir(tmp_path, "train", "llama-worker-1", "11111111-2222-3333-4444-555555555555")
    finder = ProcessFinder(pods_root=tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        assert all(p.pid != child for p in finder.find())  # looked at before its exec: no rank yet
        [proc] = _mine(finder, {child}, wait_s=20.0)
        assert (proc.rank, proc.job) == (1, "llama")
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(launcher.pid)], check=False)
        launcher.kill()
        launcher.wait()


def test_a_stopped_rank_is_seen_stopped_and_its_stack_is_still_taken(tmp_path: Path, spawn: Spawn) -> None:
    py_spy = _py_spy("py-spy")
    if py_spy is None or os.geteuid() != 0:
        pytest.skip("py-spy must be installed and run as root (ptrace)")
    _pod_dir(tmp_path, "train", "gpt-worker-0", "11111111-2222-3333-4444-555555555555")
    _pod_dir(tmp_path, "train", "gpt-worker-1", "66666666-2222-3333-4444-555555555555")
    running, stopped = spawn(0, "gpt-worker-0"), spawn(1, "gpt-worker-1")
    finder = ProcessFinder(pods_root=tmp_path)
    _mine(finder, {running.pid, stopped.pid})
    time.sleep(0.3)  # in its loop
    os.kill(stopped.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not any(p.pid == stopped.pid and p.stopped for p in finder.find()) and time.monotonic() < deadline:
        time.sleep(0.05)
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", sim_nodes=2, dry_run=True)
    kmend = make_kmend(settings, cluster=build_cluster(2, 8), notifier=LogNotifier())
    try:
        with serve_in_thread(create_app(kmend, settings)) as url:
            kmend.store.ledger.open(RepairRequest(id="stack-dump:gpt:1.000:n1", node="n1", kind="stack_dump",
                                                  params={"job": "gpt"}))
            responder = StackRequestResponder(url=url, node="n1", finder=finder, dumper=PySpyDumper(py_spy),
                                              clock=time.monotonic)
            try:
                state, message = responder.answer("gpt")
            finally:
                responder.close()
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        kmend.store.close()
    # py-spy cannot pause a stopped process; read as it is, its stack is still there.
    assert (state, message.split(";")[0]) == ("done", "2 stack(s) of 2 process(es)"), message
    kept = kmend.detectors.stacks._stacks["gpt"]
    assert (kept[1].state, kept[1].stopped, kept[0].stopped) == ("T", True, False)
    assert "train_step (<string>:3)" in kept[1].text and "train_step (<string>:3)" in kept[0].text


PROGRESS = load_progress_rules([default_progress_rules_dir()])


def test_a_job_whose_processes_ended_is_finished_not_hung(tmp_path: Path, spawn: Spawn) -> None:
    # A plain loop's step lines (no end line), then its processes end; the pods' log directories stay.
    for r in range(2):
        _pod_dir(tmp_path, "train", f"ddp-worker-{r}", f"{r}1111111-2222-3333-4444-555555555555")
    procs = [spawn(r, f"ddp-worker-{r}") for r in range(2)]
    clock = [1_800_000_000.0]
    src = ProcessExitSource(node="node-0", finder=ProcessFinder(pods_root=tmp_path), clock=lambda: clock[0],
                            interval_s=0.0)
    _mine(src.finder, {p.pid for p in procs})
    started = src.poll().signals  # each rank's process seen running: a job before its first line
    assert sorted((x.payload.job, x.payload.rank, x.payload.event) for x in started
                  if isinstance(x.payload, ProgressSample)) == [("ddp", 0, "start"), ("ddp", 1, "start")]
    assert src.poll().signals == []  # running: nothing more to say
    an = Analyzer(load_rules([default_rules_dir()]), correlator=Correlator(), detectors=DetectorSuite(PROGRESS))
    found = an.process(started)[0]
    for s in range(1, 41):
        clock[0] += 0.2
        batch = [Signal(f"node-0/container/ddp-{r}/{s}", "node-0", Source.CONTAINER, clock[0],
                        LogLine(f"step {s} loss 0.1", "train", f"ddp-worker-{r}", "trainer", "ddp", r))
                 for r in range(2)]
        found += an.process(batch)[0] + an.evaluate(clock[0])[0]
    procs[0].kill()
    procs[0].wait()
    clock[0] += 0.5
    first = src.poll().signals
    assert [(x.payload.job, x.payload.rank, x.payload.event) for x in first
            if isinstance(x.payload, ProgressSample)] == [("ddp", 0, "exit")]
    procs[1].kill()
    procs[1].wait()
    clock[0] += 0.5
    second = src.poll().signals
    assert [x.payload.rank for x in second if isinstance(x.payload, ProgressSample)] == [1]
    found += an.process(first + second)[0]
    for k in range(60):
        found += an.evaluate(clock[0] + k)[0]
    assert [f for f in found if f.fault_class is FaultClass.HANG] == []
