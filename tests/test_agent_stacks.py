"""The agent's evidence on a suspected hang: real py-spy dumps of real stuck processes, the Flight Recorder
FIFO, the stack_dump request round trip, and POST /v1/stacks input checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from collector.stacks import ProcessFinder, PySpyDumper, StackRequestResponder, TrainingProcess, cpu_seconds
from healer.notify import LogNotifier
from healer.steps.base import RepairRequest
from kmend.app import create_app
from kmend.commands.agent import _py_spy
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

STUCK = textwrap.dedent('''
    import os, subprocess, sys, time
    pipe = os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
    if pipe:
        # What ProcessGroupNCCL does with this variable: a FIFO <value><rank>.pipe opened
        # O_RDONLY|O_NONBLOCK and read by its monitor thread; a write asks for a dump.
        path = f"{pipe}{os.environ['RANK']}.pipe"
        os.mkfifo(path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    # A DataLoader worker inherits RANK: it must not be taken for the rank itself.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def wait_for_batch():
        print("ready", flush=True)  # from inside the function the stack must show
        while True:
            if pipe:
                try:
                    if os.read(fd, 16):
                        open(os.environ["DUMPED"], "w").write("dump")
                except BlockingIOError:
                    pass
            time.sleep(0.05)

    try:
        wait_for_batch()
    finally:
        child.kill()
''')


JOB = f"llm-{os.getpid()}"
"""The stuck process's job: unique per test process, since the finder reads the whole of /proc (parallel workers)."""


@pytest.fixture
def stuck(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "KMEND_JOB": JOB,
           "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "nccl_pipe_"), "DUMPED": str(tmp_path / "dumped")}
    proc = subprocess.Popen([sys.executable, "-c", STUCK], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and its worker
        proc.wait()


def _py_spy_or_skip() -> str:
    binary = _py_spy("py-spy")
    if binary is None or os.geteuid() != 0:
        pytest.skip("py-spy must be installed and run as root (ptrace)")
    return binary


def test_the_finder_takes_the_rank_process_not_its_workers(stuck: subprocess.Popen[str]) -> None:
    procs = [p for p in ProcessFinder(pods_root=None).find() if p.job == JOB]
    assert [(p.pid, p.rank) for p in procs] == [(stuck.pid, 3)]
    assert procs[0].pipe is not None and procs[0].pipe.endswith("nccl_pipe_3.pipe")


def test_py_spy_dumps_where_a_real_stuck_process_waits(stuck: subprocess.Popen[str]) -> None:
    text = PySpyDumper(_py_spy_or_skip()).dump(stuck.pid)
    assert f"Process {stuck.pid}" in text
    assert "wait_for_batch (<string>" in text and "MainThread" in text


def test_looks_at_one_process_from_several_threads_all_get_its_stack(stuck: subprocess.Popen[str]) -> None:
    # A first and a second look at a hang are answered on their own threads; two py-spy on one process at once
    # fail to trace it (EPERM), and a look with a stack missing confirms the hang it was to judge.
    dumper = PySpyDumper(_py_spy_or_skip())
    failed: list[str] = []

    def look() -> None:
        for _ in range(4):
            try:
                dumper.dump(stuck.pid)
            except RuntimeError as exc:
                failed.append(str(exc))

    threads = [threading.Thread(target=look) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []


def test_a_stack_request_is_answered_with_stacks_and_a_flight_recorder_dump(
    tmp_path: Path, stuck: subprocess.Popen[str],
) -> None:
    py_spy = _py_spy_or_skip()
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", sim_nodes=2, dry_run=True)
    kmend = make_kmend(settings, cluster=build_cluster(2, 8), notifier=LogNotifier())
    with serve_in_thread(create_app(kmend, settings)) as url:
        # What the service opens for each node of a job that stalled for half its hang threshold.
        kmend.store.ledger.open(RepairRequest(id=f"stack-dump:{JOB}:1.000:n1", node="n1", kind="stack_dump",
                                              params={"job": JOB}))
        responder = StackRequestResponder(url=url, node="n1", finder=ProcessFinder(pods_root=None),
                                          dumper=PySpyDumper(py_spy), clock=time.monotonic)
        try:
            responder.poll()
        finally:
            responder.close()
        with httpx.Client(base_url=url) as client:
            [req] = client.get("/v1/nodes/n1/requests", params={"all": True}).json()["requests"]
    kmend.store.close()
    assert req["state"] == "done" and req["result"].startswith("1 stack(s) of 1 process(es); 1 Flight Recorder")
    assert responder.captured == 1
    deadline = time.monotonic() + 5
    while not (tmp_path / "dumped").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "dumped").read_text() == "dump"
    kept = kmend.detectors.stacks._stacks[JOB][3]
    assert kept.pid == stuck.pid and "wait_for_batch" in kept.text
    used = cpu_seconds(Path("/proc"), stuck.pid)  # 0.0 for a process that has used under a tick
    assert kept.cpu_s is not None and used is not None and 0.0 <= kept.cpu_s <= used


class _Ranks:
    """A node with two ranks of one job: the finder's view, without /proc."""

    proc_root = Path("/proc")

    def find(self) -> list[TrainingProcess]:
        return [TrainingProcess(pid=101, rank=0, job="j", pipe=None, state="S"),
                TrainingProcess(pid=102, rank=1, job="j", pipe=None, state="T")]


class _SlowOnStopped:
    """py-spy's time on a loaded node: the stopped rank's dump takes a while."""

    def dump(self, pid: int, *, stopped: bool = False) -> str:
        if stopped:
            time.sleep(1.0)
        return f"Process {pid}: python\nThread {pid} (idle): \"MainThread\"\n"


def test_a_jobs_stacks_on_a_node_reach_the_service_together_when_one_dump_is_slow() -> None:
    # The service judges a job's stacks once they stop arriving for a few seconds: a slow dump of one rank between
    # two uploads had it judge the job from rank 0 alone ("every rank waits in a collective", no culprit named).
    posted: list[tuple[float, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        posted.append((time.monotonic(), request.url.params["rank"]))
        return httpx.Response(202, json={})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    responder = StackRequestResponder(url="http://kmend", node="n1", finder=_Ranks(),  # type: ignore[arg-type]
                                      dumper=_SlowOnStopped(), client=client, clock=time.monotonic)
    start = time.monotonic()
    state, message = responder.answer("j")
    responder.close()
    assert (state, message) == ("done", "2 stack(s) of 2 process(es); 0 Flight Recorder dump(s) requested")
    assert sorted(r for _, r in posted) == ["0", "1"]
    first, last = min(t for t, _ in posted), max(t for t, _ in posted)
    assert first - start >= 0.9, "a stack was sent before every rank's dump was in"
    assert last - first < 0.5


class _ProcRoot:
    """Two ranks of one job whose ``/proc/<pid>/stat`` files (in a fixture directory) give their CPU time."""

    def __init__(self, root: Path) -> None:
        self.proc_root = root
        for pid, (utime, stime) in {101: (250, 50), 102: (7, 1)}.items():
            (root / str(pid)).mkdir()
            # comm with a space and a parenthesis: fields are counted after the last ')'.
            (root / str(pid) / "stat").write_text(
                f"{pid} (pt main) x) S 1 {pid} {pid} 0 -1 4194304 10 0 0 0 {utime} {stime} 0 0 20 0 9 0 500 0 0\n")

    def find(self) -> list[TrainingProcess]:
        return [TrainingProcess(pid=pid, rank=pid - 101, job="j", pipe=None, state="S") for pid in (101, 102, 103)]

    def dump(self, pid: int, *, stopped: bool = False) -> str:
        return f"Process {pid}: python\nThread {pid} (idle): \"MainThread\"\n"


def test_each_stack_goes_with_the_cpu_time_its_process_had_used(tmp_path: Path) -> None:
    # Two looks with the same stack tell a rank blocked for good (no CPU used) from one busy in a long call.
    sent: dict[str, str | None] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent[request.url.params["rank"]] = request.url.params.get("cpu_s")
        return httpx.Response(202, json={})

    node = _ProcRoot(tmp_path)
    responder = StackRequestResponder(url="http://kmend", node="n1", finder=node,  # type: ignore[arg-type]
                                      dumper=node, client=httpx.Client(transport=httpx.MockTransport(handler)),
                                      clock=time.monotonic)
    state, _ = responder.answer("j")
    responder.close()
    tick = os.sysconf("SC_CLK_TCK")
    assert state == "done"
    assert sent == {"0": str(300 / tick), "1": str(8 / tick), "2": None}  # pid 103 has no stat: sent without


class _Traced:
    """Two ranks whose state reads ``t`` while a dump has them paused (what ptrace shows), else ``S``."""

    proc_root = Path("/proc")

    def __init__(self) -> None:
        self.states = {101: "S", 102: "S"}

    def find(self) -> list[TrainingProcess]:
        return [TrainingProcess(pid=pid, rank=pid - 101, job="j", pipe=None, state=st)
                for pid, st in self.states.items()]

    def dump(self, pid: int, *, stopped: bool = False) -> str:
        self.states[pid] = "t"
        time.sleep(0.5)
        self.states[pid] = "S"
        return f"Process {pid}: python\nThread {pid} (idle): \"MainThread\"\n"


def test_a_look_does_not_take_the_ranks_another_look_has_paused_for_stopped_ones() -> None:
    # A first and a second look at a hang are answered on their own threads; py-spy's pause shows as the tracing
    # stop, and a look that read it took every rank of a healthy pair for stopped (the service then named none).
    states: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        states.append(request.url.params["state"])
        return httpx.Response(202, json={})

    node = _Traced()
    responder = StackRequestResponder(url="http://kmend", node="n1", finder=node,  # type: ignore[arg-type]
                                      dumper=node, client=httpx.Client(transport=httpx.MockTransport(handler)),
                                      clock=time.monotonic)
    second = threading.Thread(target=responder.answer, args=("j",))
    first = threading.Thread(target=responder.answer, args=("j",))
    first.start()
    time.sleep(0.2)  # the first look's dumps have both ranks paused
    second.start()
    first.join()
    second.join()
    responder.close()
    assert states == ["S"] * 4


def test_no_process_of_the_job_answers_failed_with_why(tmp_path: Path) -> None:
    responder = StackRequestResponder(url="http://127.0.0.1:9", node="n1", finder=ProcessFinder(pods_root=None),
                                      dumper=PySpyDumper("py-spy"), clock=time.monotonic)
    state, message = responder.answer("no-such-job")
    responder.close()
    assert state == "failed" and "no process of job 'no-such-job' on n1" in message


@pytest.mark.parametrize(("params", "body", "status", "names"), [
    ({"job": "j", "rank": 0, "node": "n", "pid": 5}, b"\xff\xfe", 400, "body"),
    ({"job": "j", "rank": 0, "node": "n", "pid": 5}, b"   ", 400, "body"),
    ({"job": "j", "rank": 0, "node": "n"}, b"Thread 1", 422, "pid"),
    ({"job": "j", "rank": -1, "node": "n", "pid": 5}, b"Thread 1", 422, "rank"),
    ({"job": "j", "rank": 0, "node": "n", "pid": 5}, b"x" * (256 * 1024 + 1), 413, "larger"),
    ({"job": "j", "rank": 0, "node": "n", "pid": 5, "cpu_s": -1}, b"Thread 1", 422, "cpu_s"),
    ({"job": "j", "rank": 0, "node": "n", "pid": 5, "cpu_s": "nan"}, b"Thread 1", 422, "cpu_s"),
    ({"job": "j", "rank": 0, "node": "n", "pid": 5, "cpu_s": "lots"}, b"Thread 1", 422, "cpu_s"),
])
def test_bad_stack_uploads_get_a_4xx_naming_the_field(tmp_path: Path, params: dict[str, object], body: bytes,
                                                     status: int, names: str) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", sim_nodes=2, dry_run=True)
    kmend = make_kmend(settings, cluster=build_cluster(2, 8), notifier=LogNotifier())
    with serve_in_thread(create_app(kmend, settings)) as url, httpx.Client(base_url=url) as client:
        resp = client.post("/v1/stacks", params=params, content=body)
    kmend.store.close()
    assert resp.status_code == status and names in resp.text, resp.text
