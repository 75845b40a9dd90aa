"""Real PyTorch jobs (torchrun, gloo, 4 CPU ranks) watched by the running service: a straggler and a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.progress_file import ProgressFileSource
from collector.signal import LogLine, Signal, Source
from collector.wire import to_wire
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

JOB = Path(__file__).parent / "jobs" / "tiny_ddp.py"
WORLD = 4
GLOO_TIMEOUT_S = 10.0
NODES = ("gpu-node-00", "gpu-node-01")  # two ranks per "node", as two pods would be placed


def node_of(rank: int) -> str:
    return NODES[rank // 2]


@dataclass
class Agent:
    """What the node agent does for these pods: tail each rank's log and the hook files, ship them."""

    log_dir: Path
    progress_dir: Path
    job: str
    offsets: dict[str, int] = field(default_factory=dict)
    sources: dict[str, ProgressFileSource] = field(default_factory=dict)
    step_lines_at: float = 0.0

    def poll(self) -> list[Signal]:
        out: list[Signal] = []
        now = time.time()
        for path in sorted(self.log_dir.glob("rank*.log")):
            rank = int(path.stem[4:])
            start = self.offsets.get(path.name, 0)
            data = path.read_bytes()[start:]
            end = data.rfind(b"\n") + 1
            for i, raw in enumerate(data[:end].splitlines()):
                text = raw.decode(errors="replace")
                if text.startswith("step "):
                    self.step_lines_at = now
                out.append(Signal(f"{node_of(rank)}/container/{self.job}-{rank}/{start}/{i}", node_of(rank),
                                  Source.CONTAINER, now,
                                  LogLine(text, namespace="training", pod=f"{self.job}-{rank}", container="trainer",
                                          job=self.job, rank=rank)))
            self.offsets[path.name] = start + end
        # The hook's files sit on the node of the rank that wrote them (shared here, split by rank).
        for node in NODES:
            src = self.sources.setdefault(node, ProgressFileSource(self.progress_dir, node))
            out.extend(s for s in src.poll().signals if node_of(_rank_of(s)) == node)
        return out


def _rank_of(sig: Signal) -> int:
    return int(getattr(sig.payload, "rank", 0))


def _launch(tmp: Path, job: str, steps: int, extra: dict[str, str]) -> tuple[subprocess.Popen[bytes], Agent]:
    logs, progress, fr = tmp / "logs", tmp / "progress", tmp / "fr"
    for d in (logs, progress, fr):
        d.mkdir()
    env = {**os.environ, "KMEND_PROGRESS_DIR": str(progress), "KMEND_JOB": job, "KMEND_TEST_LOG_DIR": str(logs),
           "KMEND_TEST_FR_DIR": str(fr), "KMEND_TEST_STEPS": str(steps), "TORCH_FR_BUFFER_SIZE": "200",
           "KMEND_TEST_GLOO_TIMEOUT_S": str(GLOO_TIMEOUT_S), "OMP_NUM_THREADS": "1", **extra}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.Popen([torchrun, "--standalone", f"--nproc-per-node={WORLD}", str(JOB)], env=env,
                            stdout=(tmp / "torchrun.out").open("wb"), stderr=subprocess.STDOUT)
    return proc, Agent(logs, progress, job)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Kmend, httpx.Client]]:
    # A short floor suits a job stepping every ~0.1 s; the 30 s target still holds with the default.
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", sim_nodes=2,
                        healer_interval_s=0.1, detector_interval_s=0.25, hang_floor_s=3.0, dry_run=True,
                        flight_recorder_settle_s=2.0)
    kmend = make_kmend(settings, cluster=build_cluster(2, 8), notifier=LogNotifier())
    with serve_in_thread(create_app(kmend, settings)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield kmend, client
    kmend.store.close()


def _ship(client: httpx.Client, signals: list[Signal]) -> None:
    if signals:
        resp = client.post("/v1/signals", json={"signals": [to_wire(s) for s in signals]})
        assert resp.status_code == 200, resp.text


def _incidents(client: httpx.Client) -> list[dict[str, Any]]:
    return [client.get(f"/v1/incidents/{i['id']}").json() for i in client.get("/v1/incidents").json()["incidents"]]


def test_a_rank_that_sleeps_every_step_is_named_a_straggler(tmp_path: Path,
                                                            service: tuple[Kmend, httpx.Client]) -> None:
    _, client = service
    proc, agent = _launch(tmp_path, "tiny-straggle", 30, {"KMEND_TEST_SLOW_RANK": "1", "KMEND_TEST_SLOW_S": "0.1"})
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        _ship(client, agent.poll())
        time.sleep(0.2)
    assert proc.wait(timeout=30) == 0, (tmp_path / "torchrun.out").read_text()[-3000:]
    _ship(client, agent.poll())
    time.sleep(0.5)  # one more detector round
    stragglers = [f for inc in _incidents(client) for f in inc["findings"] if f["fault_class"] == "straggler"]
    book = service[0].detectors.book.jobs.get("tiny-straggle")
    state = {r: (st.basis, [round(t, 3) for t in st.times]) for r, st in book.ranks.items()} if book else None
    assert stragglers, f"no straggler finding; ranks: {state}"
    assert {f["where"]["rank"] for f in stragglers} == {1}, [f["message"] for f in stragglers]
    [f] = stragglers
    assert f["where"]["node"] == "gpu-node-00" and float(f["fields"]["slowdown"]) > 2
    assert f["fields"]["basis"] == "compute"


def test_a_rank_blocked_before_a_collective_is_a_hang_named_long_before_gloos_timeout(
    tmp_path: Path, service: tuple[Kmend, httpx.Client],
) -> None:
    _, client = service
    proc, agent = _launch(tmp_path, "tiny-hang", 1000, {"KMEND_TEST_HANG_RANK": "2", "KMEND_TEST_HANG_STEP": "15"})
    hang: dict[str, Any] | None = None
    detected_after = None
    deadline = time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        _ship(client, agent.poll())
        if hang is None:
            found = [i for i in _incidents(client) if i["fault_class"] == "hang"]
            if found:
                hang = found[0]
                detected_after = time.time() - agent.step_lines_at
        time.sleep(0.2)
    proc.wait(timeout=60)
    _ship(client, agent.poll())
    assert hang is not None and detected_after is not None, (tmp_path / "torchrun.out").read_text()[-3000:]
    # Named within the target (max(5 x median step, 30 s)) and well before gloo gave up.
    assert detected_after < min(30.0, GLOO_TIMEOUT_S / 2)
    assert (hang["root_cause"]["rank"], hang["root_cause"]["node"]) == (2, "gpu-node-01")
    # The real timeout lines of the other ranks fold into the same incident.
    time.sleep(0.5)
    [inc] = [i for i in _incidents(client) if i["id"] == hang["id"]]
    rules = [f["rule_id"] for f in inc["findings"]]
    assert rules.count("gloo-collective-timeout") >= 2, rules
    assert {f["where"]["rank"] for f in inc["findings"] if f["rule_id"] == "gloo-collective-timeout"} <= {0, 1, 3}
    assert inc["root_cause"]["rank"] == 2
    assert len([i for i in _incidents(client) if "training/tiny-hang" in i["jobs"]]) == 1  # namespace/job
    # The Flight Recorder dumps the failed ranks wrote agree: rank 2 never joined.
    for dump in sorted((tmp_path / "fr").glob("rank*")):
        r = int(dump.name[4:])
        resp = client.post("/v1/flight-recorder", params={"job": "tiny-hang", "rank": r, "node": node_of(r)},
                           content=dump.read_bytes())
        assert resp.status_code == 202, resp.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        [inc] = [i for i in _incidents(client) if i["id"] == hang["id"]]
        if "flight-recorder" in {f["rule_id"] for f in inc["findings"]}:
            break
        time.sleep(0.5)
    [fr] = [f for f in inc["findings"] if f["rule_id"] == "flight-recorder"]
    assert fr["where"]["rank"] == 2 and fr["fields"]["silent_ranks"] == "2"
    assert inc["root_cause"]["rank"] == 2 and "narrowed by flight-recorder" in inc["timeline"][-1]["what"]
