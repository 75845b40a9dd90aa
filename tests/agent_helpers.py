"""Helpers for agent tests: writing CRI log lines and rotating files like kubelet and logrotate."""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from sqlalchemy import text

from collector.signal import Signal
from collector.spool import DiskSpool
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agent"
TOKEN = "s3cret"


class CriWriter:
    """Appends CRI-format lines to ``<root>/<ns>_<pod>_<uid>/<container>/0.log``."""

    def __init__(self, root: Path, ns: str = "train", pod: str = "llama-worker-0",
                 uid: str = "0000-1111", container: str = "trainer") -> None:
        self.dir = root / f"{ns}_{pod}_{uid}" / container
        self.dir.mkdir(parents=True, exist_ok=True)
        self.live = self.dir / "0.log"
        self.n = 0

    def line(self, msg: str, *, tag: str = "F", stream: str = "stdout") -> None:
        self.n += 1
        ts = f"2026-11-21T10:{self.n // 60 % 60:02d}:{self.n % 60:02d}.{self.n:09d}Z"
        with open(self.live, "a") as fh:
            fh.write(f"{ts} {stream} {tag} {msg}\n")

    def rotate_rename(self, suffix: str = "20261121-100000") -> Path:
        """kubelet: rename the live file away; the runtime reopens a fresh one."""
        rotated = self.dir / f"0.log.{suffix}"
        os.rename(self.live, rotated)
        return rotated

    def compress(self, rotated: Path) -> Path:
        """kubelet: gzip a rotated file into ``.gz`` (via ``.gz.tmp``) and delete the original."""
        tmp = rotated.with_name(rotated.name + ".gz.tmp")
        with open(rotated, "rb") as src, gzip.open(tmp, "wb") as dst:
            dst.write(src.read())
        final = rotated.with_name(rotated.name + ".gz")
        os.rename(tmp, final)
        rotated.unlink()
        return final

    def copytruncate(self) -> Path:
        """logrotate copytruncate: copy the live file, then truncate it in place."""
        copy = self.dir / "0.log.1"
        copy.write_bytes(self.live.read_bytes())
        with open(self.live, "r+") as fh:
            fh.truncate(0)
        return copy


def texts(signals: list[Signal]) -> list[str]:
    """The log text of each signal."""
    return [s.text or "" for s in signals]


class Service:
    """The real kmend service on a chosen loopback port, startable and stoppable."""

    def __init__(self, tmp_path: Path, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim",
                                 ingest_token=TOKEN, symptom_settle_s=3600)
        self.kmend = make_kmend(self.settings, cluster=build_cluster(4), notifier=LogNotifier())
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        app = create_app(self.kmend, self.settings, run_healer=False)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "service did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        assert self._server and self._thread
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def stored_ids(self, source: str | None = None) -> list[str]:
        """Ids of the stored signals, oldest first."""
        q = "SELECT id FROM signals" + (" WHERE source = :s" if source else "") + " ORDER BY ts, id"
        with self.kmend.store.engine.connect() as conn:
            return [r[0] for r in conn.execute(text(q), {"s": source})]

    def stored(self, source: str) -> list[dict[str, object]]:
        """Stored signals of one source as wire dicts."""
        with self.kmend.store.engine.connect() as conn:
            rows = conn.execute(text("SELECT id, node, body FROM signals WHERE source = :s ORDER BY ts, id"),
                                {"s": source})
            return [{"id": r[0], "node": r[1], "body": json.loads(r[2]) if isinstance(r[2], str) else r[2]}
                    for r in rows]


def spooled(state: Path) -> list[dict[str, Any]]:
    """Every signal an agent with state directory `state` has spooled, in order (the spool is emptied)."""
    spool = DiskSpool(state / "spool")
    out: list[dict[str, Any]] = []
    while (batch := spool.peek()) is not None:
        out.extend(json.loads(gzip.decompress(spool.read(batch)))["signals"])
        spool.pop(batch)
    return out
