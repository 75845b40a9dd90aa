"""Harness for the real-job tests: unmodified trainers under torchrun, one pod per rank, watched through CRI files.

Each "pod" is a torchrun process (one node of the job, one worker) whose stdout and stderr
are written the way the container runtime writes them: ``<ts> <stream> <P|F> <text>`` lines
under ``<root>/<namespace>_<pod>_<uid>/<container>/0.log``, a line longer than 16 KiB cut
into partial records. ``kmend serve`` and ``kmend agent`` run as their own processes and
see only those files, as on a node.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import httpx

from tests.conftest import REPO, free_port
from tests.procs import wait_ready

JOBS = Path(__file__).resolve().parent / "jobs"
INJECT = JOBS / "inject"
NODE = "gpu-node-00"
NAMESPACE = "train"
CRI_MAX = 16 * 1024
"""containerd's line limit: longer output is written as partial (P) records."""


def _stamp() -> str:
    now = time.time_ns()
    return datetime.fromtimestamp(now // 1_000_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{now % 10**9:09d}Z"


class CriFile:
    """One container's log file, shared by its stdout and stderr pumps."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()
        self.last_write = 0.0

    def pump(self, stream: IO[bytes], name: str) -> None:
        buf = b""
        while chunk := os.read(stream.fileno(), 65536):
            buf += chunk
            while (nl := buf.find(b"\n")) >= 0:
                self._write(name, b"F", buf[:nl])
                buf = buf[nl + 1:]
            while len(buf) >= CRI_MAX:
                self._write(name, b"P", buf[:CRI_MAX])
                buf = buf[CRI_MAX:]
        if buf:
            self._write(name, b"F", buf)

    def _write(self, name: str, tag: bytes, data: bytes) -> None:
        with self._lock:
            self._fh.write(_stamp().encode() + b" " + name.encode() + b" " + tag + b" " + data + b"\n")
            self.last_write = time.time()

    def close(self) -> None:
        self._fh.close()


@dataclass
class Pod:
    """One torchrun node of the job, as a pod: its output lands in a CRI log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: CriFile
    threads: list[threading.Thread] = field(default_factory=list)

    def worker_pids(self) -> list[int]:
        """The training processes torchrun started (children of the launcher)."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return [int(p) for p in path.read_text().split()]
        except OSError:
            return []

    def text(self) -> str:
        """The log as written (bytes decoded: reading as text would turn a bar's \r into line ends)."""
        return self.log.path.read_bytes().decode(errors="replace")

    def stop(self) -> None:
        # torchrun starts each worker in a session of its own: killing the launcher's group leaves them.
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for t in self.threads:
            t.join(timeout=10)
        self.log.close()


class Job:
    """A torchrun job of `world` single-worker pods, on one node or on the nodes of `pod_roots` (one per pod);
    `args` follow the steps on the script's command line."""

    def __init__(self, root: Path, name: str, script: str, steps: int, world: int,
                 fault: dict[str, str] | None = None, env: dict[str, str] | None = None,
                 pod_roots: list[Path] | None = None, args: tuple[str, ...] = ()) -> None:
        self.root, self.name, self.world = root, name, world
        self.pods: list[Pod] = []
        port = free_port()
        # The job's temporary files (the Trainer's output directory, checkpoints included) stay in the test's own
        # directory, which pytest removes: in the system's they were left behind by every run, some 66 MB each.
        tmp = root.parent / f"tmp-{name}"
        tmp.mkdir(exist_ok=True)
        for r in range(world):
            pod = f"{name}-worker-{r}"
            penv = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HOSTNAME": pod,
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp), **(env or {})}
            if fault is not None and fault.get("KMEND_FAULT_RANK") == str(r):
                penv.update(fault)
                penv["PYTHONPATH"] = os.pathsep.join([str(INJECT), penv.get("PYTHONPATH", "")])
            argv = [str(Path(sys.executable).parent / "torchrun"), f"--nnodes={world}", f"--node-rank={r}",
                    "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                    str(JOBS / script), str(steps), *args]
            log = CriFile((pod_roots[r] if pod_roots else root) / f"{NAMESPACE}_{pod}_{uuid.uuid4()}" / "trainer"
                          / "0.log")
            proc = subprocess.Popen(argv, env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, cwd=REPO)
            assert proc.stdout is not None and proc.stderr is not None
            threads = [threading.Thread(target=log.pump, args=(s, n), daemon=True)
                       for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
            for t in threads:
                t.start()
            self.pods.append(Pod(pod, proc, log, threads))

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.proc.poll() is None for p in self.pods):
            time.sleep(0.2)
        return [p.proc.poll() for p in self.pods]

    def stop(self) -> None:
        for p in self.pods:
            p.stop()

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.text()[-3000:]}" for p in self.pods)


class Proc:
    """A kmend subcommand as its own process."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        # Its temporary files (a survey's samples, left by a process stopped in the middle) stay beside its log.
        with open(log, "ab") as fh:
            self.p = subprocess.Popen([sys.executable, "-m", "kmend.cli", *args], cwd=REPO,
                                      env={**os.environ, "TMPDIR": str(log.parent), **env}, stdout=fh,
                                      stderr=subprocess.STDOUT)
        self.log = log

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)


@dataclass
class Kmend:
    """The service and a node agent per node, each watching its node's pod logs (`pods`: the first node's)."""

    url: str
    pods: Path
    client: httpx.Client
    db: Path
    node_pods: dict[str, Path] = field(default_factory=dict)
    """Each node's pod log directory."""
    start_agents: Callable[[], None] = lambda: None
    """Start the node agents (once; ``running_kmend(..., agents=False)`` leaves them to the test)."""

    def stored_lines(self, needle: str) -> list[str]:
        """Texts of the container lines the service stored that contain `needle` (what the agent shipped)."""
        with sqlite3.connect(self.db) as conn:
            rows = conn.execute("SELECT body FROM signals WHERE source = 'container'").fetchall()
        texts = [json.loads(r[0]).get("payload", {}).get("text", "") for r in rows]
        return [t for t in texts if needle in t]

    def progress_received(self) -> float:
        """Progress records the service took in (the agents summarise their pods' step lines)."""
        from prometheus_client.parser import text_string_to_metric_families

        body = self.client.get("/metrics").text
        return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
                   if s.name == "kmend_ingest_signals_total" and s.labels.get("source") == "progress")

    def incidents(self) -> list[dict[str, Any]]:
        listed = self.client.get("/v1/incidents").json()["incidents"]
        return [self.client.get(f"/v1/incidents/{i['id']}").json() for i in listed]

    def nodes(self) -> dict[str, dict[str, Any]]:
        body: dict[str, dict[str, Any]] = self.client.get("/v1/nodes").json()["nodes"]
        return body

    def wait_for(self, pred: Callable[[list[dict[str, Any]]], bool], timeout: float,
                 job: Job | None = None) -> list[dict[str, Any]]:
        """Incidents once `pred` holds, or at the timeout, or a few seconds after `job` ended."""
        deadline = time.monotonic() + timeout
        incs = self.incidents()
        while not pred(incs) and time.monotonic() < deadline:
            if job is not None and all(p.proc.poll() is not None for p in job.pods):
                deadline = min(deadline, time.monotonic() + 3.0)
            time.sleep(0.25)
            incs = self.incidents()
        return incs


SERVICE_ENV = {
    # How often the detectors run; the defaults otherwise, except a shorter hang floor so a test
    # that waits out a finished job stays short (the floor is an operator setting).
    "KMEND_DETECTOR_INTERVAL_S": "0.25",
    "KMEND_HANG_FLOOR_S": "10",
    "KMEND_SYMPTOM_SETTLE_S": "1",
}


def _wait_agent_started(agent: Proc, node: str, timeout: float = 120.0) -> None:
    """Until the agent watches its node (its sources built): a job started before that ends unseen by the
    process source on a loaded machine, and its steps read later look like a job that stopped."""
    deadline = time.monotonic() + timeout
    while f"agent on {node}:" not in agent.log.read_text(errors="replace"):
        assert agent.p.poll() is None, agent.log.read_text(errors="replace")
        assert time.monotonic() < deadline, f"agent on {node} not started in {timeout} s"
        time.sleep(0.1)


@contextmanager
def running_kmend(tmp: Path, env: dict[str, str] | None = None, nodes: tuple[str, ...] = (NODE,),
                  agents: bool = True, agent_args: tuple[str, ...] = ()) -> Iterator[Kmend]:
    """`kmend serve` (simulated cluster, SQLite) and a `kmend agent` per node (NODE alone by default), as separate
    processes; each agent has its own pod log directory and state, as on its own machine. With `agents` False,
    the agents start when the test calls ``start_agents`` (an agent that comes up after a job began or ended);
    `agent_args` are added to every agent's command line."""
    node_pods = {node: tmp / ("pods" if i == 0 else f"pods-{node}") for i, node in enumerate(nodes)}
    for d in node_pods.values():
        d.mkdir()
    pods = node_pods[nodes[0]]
    port = free_port()
    service = Proc(["serve", "--port", str(port), "--database-url", f"sqlite:///{tmp / 'kmend.db'}",
                    "--cluster", "sim"], tmp / "service.log", {**SERVICE_ENV, **(env or {})})
    agents_list: list[Proc] = []
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            wait_ready(url, service.p, log=tmp / "service.log")

            def start_agents() -> None:
                if agents_list:
                    return
                for i, (node, root) in enumerate(node_pods.items()):
                    suffix = "" if i == 0 else f"-{node}"
                    agents_list.append(Proc(["agent", "--node", node, "--service-url", url,
                                            "--state-dir", str(tmp / f"agent{suffix}"), "--pods-root", str(root),
                                            "--kernel", "off", "--no-nvml", "--no-pod-labels",
                                            "--ib-root", str(tmp / "no-ib"), "--poll-interval", "0.2",
                                            # Step lines leave as per-rank summaries (each step's time listed)
                                            # at the default window: these jobs step every 10-150 ms, and a
                                            # window closes every 16 steps too, so a slow rank is still named
                                            # within 30 steps.
                                            "--flush-interval", "0.2", "--status-port", "0", *agent_args],
                                           tmp / f"agent{suffix}.log", {}))
                for node, agent in zip(node_pods, agents_list, strict=True):
                    _wait_agent_started(agent, node)

            if agents:
                start_agents()
            yield Kmend(url, pods, client, tmp / "kmend.db", node_pods, start_agents)
    finally:
        for agent in agents_list:
            agent.stop()
        service.stop()


def of_class(incidents: list[dict[str, Any]], fault_class: str) -> list[dict[str, Any]]:
    """The incidents of one fault class."""
    return [i for i in incidents if i["fault_class"] == fault_class]
