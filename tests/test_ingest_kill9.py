"""kill -9 of `kmend serve` while agents post numbered batches (group commit): every batch answered 200 is
in the database the moment the process dies, and after a restart the agents' resends store every line once."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from collector.shipper import encode_batch
from collector.signal import Signal
from tests.builders import XID79, container, kernel
from tests.conftest import free_port
from tests.procs import wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

T0 = 1_700_000_000.0
PRODUCERS = 4
BATCHES = 60
LINES = 40
GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def _make(p: int, seq: int) -> list[Signal]:
    node = f"gpu-node-{p:02d}"
    sigs = [container(node, f"[rank{p}]: iteration {seq * LINES + i} loss 2.5", rank=p, ts=T0 + seq + i / 100)
            for i in range(LINES)]
    if seq == 7:
        sigs.append(kernel(node, XID79, ts=T0 + seq))
    return sigs


BODIES = {(p, seq): _make(p, seq) for p in range(PRODUCERS) for seq in range(1, BATCHES + 1)}
"""Each agent's batches, built once: a resent batch carries the same ids."""


def _batch(p: int, seq: int) -> list[Signal]:
    return BODIES[(p, seq)]


def _start(tmp: Path, db: Path, n: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "KMEND_DATABASE_URL": f"sqlite:///{db}", "KMEND_CLUSTER": "sim", "KMEND_PORT": str(port),
           "KMEND_SIM_NODES": "8", "KMEND_SYMPTOM_SETTLE_S": "3600"}
    log = tmp / f"serve-{n}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, stdout=subprocess.DEVNULL,
                                stderr=out)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log=log)
    return proc, url


def _agent(url: str, p: int, first: int, acked: list[int], stop: threading.Event) -> None:
    """Post batches `first`.. in order, as an agent does; record each one answered 200; stop at the first failure."""
    with httpx.Client(base_url=url, timeout=30) as c:
        for seq in range(first, BATCHES + 1):
            if stop.is_set():
                return
            try:
                r = c.post("/v1/signals", content=encode_batch(_batch(p, seq), producer=f"agent-{p}", seq=seq),
                           headers=GZIP)
            except httpx.HTTPError:
                return
            if r.status_code != 200:
                return
            acked.append(seq)


def test_every_acknowledged_batch_survives_kill_9_and_resends_store_each_line_once(tmp_path: Path) -> None:
    db = tmp_path / "kmend.db"
    proc, url = _start(tmp_path, db, 0)
    acked: list[list[int]] = [[] for _ in range(PRODUCERS)]
    stop = threading.Event()
    agents = [threading.Thread(target=_agent, args=(url, p, 1, acked[p], stop)) for p in range(PRODUCERS)]
    for t in agents:
        t.start()
    try:
        deadline = threading.Event()
        while sum(map(len, acked)) < PRODUCERS * BATCHES // 3 and not deadline.wait(0.005):
            assert any(t.is_alive() for t in agents), "the agents stopped before the kill"
        proc.kill()  # SIGKILL, with batches in flight
        proc.wait(30)
    finally:
        stop.set()
        for t in agents:
            t.join(60)
    answered = [list(a) for a in acked]
    assert all(answered), answered

    # The moment the process died: every answered batch is stored whole, and its producer's mark covers it.
    with sqlite3.connect(db) as conn:
        ids = {r[0] for r in conn.execute("SELECT id FROM signals")}
        marks = dict(conn.execute("SELECT id, seq FROM producers").fetchall())
    for p, seqs in enumerate(answered):
        for seq in seqs:
            missing = {s.id for s in _batch(p, seq)} - ids
            assert not missing, f"agent-{p} batch {seq} was answered 200 but {len(missing)} of its lines were lost"
        assert marks.get(f"agent-{p}", 0) >= max(seqs)

    # Restarted, each agent sends again from its last answered batch (a replay) to the end.
    proc, url = _start(tmp_path, db, 1)
    try:
        again: list[list[int]] = [[] for _ in range(PRODUCERS)]
        agents = [threading.Thread(target=_agent, args=(url, p, max(answered[p]), again[p], threading.Event()))
                  for p in range(PRODUCERS)]
        for t in agents:
            t.start()
        for t in agents:
            t.join(120)
        assert all(a and a[-1] == BATCHES for a in again), again
        with httpx.Client(base_url=url, timeout=30) as c:
            incidents = c.get("/v1/incidents").json()["incidents"]
    finally:
        proc.kill()
        proc.wait(30)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT count(*), count(DISTINCT id) FROM signals").fetchone()
        findings = conn.execute("SELECT count(*) FROM findings WHERE node LIKE 'gpu-node-0%'").fetchone()[0]
    expected = PRODUCERS * (BATCHES * LINES + 1)
    assert rows == (expected, expected), f"{rows[0]} rows for {expected} lines"
    assert findings == PRODUCERS, f"{findings} findings for {PRODUCERS} Xid lines"
    assert sorted(i["root_cause"]["node"] for i in incidents if i["fault_class"] == "gpu_lost") == \
        [f"gpu-node-{p:02d}" for p in range(PRODUCERS)]
