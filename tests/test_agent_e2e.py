"""End to end, agent and service as separate processes: rotations, service and agent killed mid-stream.

Every fault line written must produce its finding exactly once, and nothing may be lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from kmend.store import Store
from tests.agent_helpers import TOKEN, CriWriter
from tests.conftest import REPO, free_port
from tests.procs import wait_ready

pytestmark = pytest.mark.slow

FAULT_RULES = {"cuda-oom", "nccl-watchdog-timeout", "xid-79"}


class Proc:
    """A kmend subcommand run as its own process."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.args, self.log, self.env = args, log, env
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as fh:
            self.p = subprocess.Popen([sys.executable, "-m", "kmend.cli", *self.args], cwd=REPO,
                                      env={**os.environ, **self.env}, stdout=fh, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.p is not None
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def agent_metric(port: int, name: str) -> float:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name)


def test_agent_and_service_lose_nothing_and_duplicate_nothing(tmp_path: Path) -> None:
    pods, state, logs = tmp_path / "pods", tmp_path / "state", tmp_path / "log"
    logs.mkdir()
    db = f"sqlite:///{tmp_path / 'kmend.db'}"
    (tmp_path / "token").write_text(TOKEN + "\n")
    port, status_port = free_port(), free_port()
    service = Proc(["serve", "--port", str(port), "--database-url", db, "--cluster", "sim"],
                   tmp_path / "service.log", {"KMEND_INGEST_TOKEN": TOKEN, "KMEND_SYMPTOM_SETTLE_S": "3600"})
    agent = Proc(["agent", "--node", "gpu-node-07", "--service-url", f"http://127.0.0.1:{port}",
                  "--token-file", str(tmp_path / "token"), "--state-dir", str(state), "--pods-root", str(pods),
                  "--kernel", "file", "--kern-log", str(logs / "kern.log"), "--ib-root", str(tmp_path / "no-ib"),
                  "--no-nvml", "--no-pod-labels", "--poll-interval", "0.1", "--flush-interval", "0.2",
                  "--status-port", str(status_port), "--status-host", "127.0.0.1"],
                  tmp_path / "agent.log", {})
    w1 = CriWriter(pods, pod="llama-worker-0", uid="u0")
    w2 = CriWriter(pods, pod="llama-worker-1", uid="u1")
    kern = logs / "kern.log"
    faults: list[str] = []
    n = [0]

    def burst(noise: int = 10) -> None:
        for w in (w1, w2):
            for i in range(noise):
                # Lines neither a fault rule nor a progress rule matches: the prefilter drops them.
                w.line(f"dataloader worker {n[0]}.{i} prefetched 64 samples")
            n[0] += 1
            oom = f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {n[0]}.00 GiB"
            w.line(oom, stream="stderr")
            faults.append(oom)
            nccl = (f"[rank{n[0]}]: [Rank {n[0]}] Watchdog caught collective operation timeout: "
                    f"WorkNCCL(SeqNum={n[0]}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000)")
            w.line(nccl)
            faults.append(nccl)
        xid = f"NVRM: Xid (PCI:0000:3b:00): 79, pid={1000 + n[0]}, GPU has fallen off the bus."
        with open(kern, "a") as fh:
            fh.write(f"2026-11-21T10:00:{n[0] % 60:02d}+00:00 gpu-node-07 kernel: [ 51.0] {xid}\n")
        faults.append(xid)

    def stored_count() -> int:
        with Store(db).engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM signals")).scalar_one())

    try:
        service.start()
        assert service.p is not None
        wait_ready(f"http://127.0.0.1:{port}", service.p, log=tmp_path / "service.log")
        agent.start()
        burst()
        wait_for(lambda: stored_count() == len(faults), 90, "first burst shipped")

        # Rotation by rename in the middle of a partial line, copytruncate on the other pod.
        w1.line("long line first half, ", tag="P")
        rotated = w1.rotate_rename("20261121-100100")
        w1.line("second half")
        w2.copytruncate()
        burst()
        wait_for(lambda: stored_count() == len(faults), 90, "after rotation")

        # The service dies: the agent spools, then replays when it is back.
        service.kill()
        burst()
        burst()
        wait_for(lambda: agent_metric(status_port, "kmend_agent_signals_spooled_total") > 0, 90, "spooling")
        service.start()
        assert service.p is not None
        wait_ready(f"http://127.0.0.1:{port}", service.p, log=tmp_path / "service.log")
        wait_for(lambda: stored_count() == len(faults), 90, "spool replayed")

        # The agent dies mid-stream; logs keep rotating (and get compressed) while it is down.
        burst()
        agent.kill()
        burst()
        w1.compress(rotated)
        second = w1.rotate_rename("20261121-100200")
        burst()
        kern.rename(logs / "kern.log.1")
        burst()
        w1.compress(second)
        agent.start()
        burst()
        wait_for(lambda: stored_count() == len(faults), 90, "after agent restart")
        time.sleep(1.0)  # anything late would show up now
    finally:
        agent.stop()
        service.stop()

    store = Store(db)
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT id, body FROM signals")).all()
    texts = {r[0]: json.loads(r[1])["payload"]["text"] if isinstance(r[1], str) else r[1]["payload"]["text"]
             for r in rows}
    assert Counter(texts.values()) == Counter(faults), "every fault line stored exactly once"
    found = [f for f in store.findings_in_order() if f.rule_id in FAULT_RULES]
    per_line = Counter(texts[f.evidence[0]] for f in found)
    assert per_line == Counter(faults), "every fault line produced exactly one finding"
    assert len(faults) == 9 * 5
    store.close()
