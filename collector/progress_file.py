"""Reads the JSON-lines files written by ``collector.progress_hook`` into progress signals.

The node agent calls ``ProgressFileSource.poll()`` on its usual cadence. Offsets are
kept per file so each line becomes one signal once; the signal id is node + file
name + byte offset, so a re-read after a restart is deduplicated by the service.
A partial last line (the writer is mid-append) is left for the next poll; a malformed
line is skipped, never fatal.
"""

from __future__ import annotations

import json
from pathlib import Path

from collector.signal import ProgressSample, Signal, Source


class ProgressFileSource:
    """Tails ``*.jsonl`` progress files under one directory (filesystem root injected)."""

    def __init__(self, directory: Path, node: str) -> None:
        self.directory = directory
        self.node = node
        self.offsets: dict[str, int] = {}
        self.skipped = 0

    def poll(self) -> list[Signal]:
        """New progress signals since the last poll."""
        out: list[Signal] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            out.extend(self._read(path))
        return out

    def _read(self, path: Path) -> list[Signal]:
        start = self.offsets.get(path.name, 0)
        try:
            size = path.stat().st_size
            if size < start:
                start = 0  # truncated or replaced: read from the top again
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read()
        except OSError:
            return []
        out: list[Signal] = []
        pos = 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            sig = self._parse(path.name, start + pos, data[pos:nl])
            if sig is not None:
                out.append(sig)
            pos = nl + 1
        self.offsets[path.name] = start + pos
        return out

    def _parse(self, name: str, offset: int, raw: bytes) -> Signal | None:
        try:
            rec = json.loads(raw)
            phases = {str(k): float(v) for k, v in dict(rec.get("phases") or {}).items()}
            st = rec.get("step_time")
            sample = ProgressSample(job=str(rec["job"]), rank=int(rec["rank"]), step=int(rec["step"]),
                                    step_time=None if st is None else float(st), phases=phases)
            ts = float(rec["ts"])
        except (ValueError, KeyError, TypeError):
            self.skipped += 1
            return None
        return Signal(id=f"{self.node}/progress/{name}/{offset}", node=self.node, source=Source.PROGRESS, ts=ts,
                      payload=sample)
