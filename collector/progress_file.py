"""Reads the JSON-lines files written by ``collector.progress_hook`` into progress signals.

The node agent polls ``ProgressFileSource`` on its usual cadence, like any other
source. Offsets are kept per file and handed back as cursors, so the agent
checkpoints them only after the signals before them were shipped or spooled; a
restarted agent resumes from there. The signal id is node + file name + byte
offset, so a re-read after a crash is deduplicated by the service. A partial last
line (the writer is mid-append) is left for the next poll; a malformed line is
skipped and counted, never fatal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from collector.identity import pod_identity
from collector.podmeta import PodMetadataProvider
from collector.signal import ProgressSample, Signal, Source
from collector.sources.base import Cursor, Poll

MAX_READ_BYTES = 1 << 20
"""Most bytes read from one file per poll: a long backlog is drained over several polls."""


class ProgressFileSource:
    """Tails ``*.jsonl`` progress files under one directory (filesystem root injected)."""

    name = "progress"

    def __init__(self, directory: Path, node: str, *, resume: Mapping[str, Cursor] | None = None,
                 max_read_bytes: int = MAX_READ_BYTES, pod_metadata: PodMetadataProvider | None = None,
                 job: str | None = None) -> None:
        self.directory = directory
        self.pod_metadata = pod_metadata
        self.job = job
        self._pod_jobs: dict[tuple[str, str], str] = {}
        self.node = node
        self.max_read_bytes = max_read_bytes
        self.offsets: dict[str, int] = {k: int(v) for k, v in (resume or {}).items() if isinstance(v, int)}
        self.skipped = 0
        """Malformed lines skipped since start."""

    def poll(self) -> Poll:
        """New progress signals since the last poll, and the offsets they complete."""
        signals: list[Signal] = []
        cursors: dict[str, Cursor] = {}
        skipped_before = self.skipped
        lines = 0
        present: set[str] = set()
        for path in sorted(self.directory.glob("*.jsonl")):
            present.add(path.name)
            before = self.offsets.get(path.name)
            got, n = self._read(path)
            signals.extend(got)
            lines += n
            if self.offsets.get(path.name) != before:
                cursors[path.name] = self.offsets[path.name]
        for gone in [name for name in self.offsets if name not in present]:
            # The job's files were cleaned up: forget them so the checkpoint does not grow forever.
            del self.offsets[gone]
            cursors[gone] = None
        return Poll(signals=signals, cursors=cursors, lines=lines, errors=self.skipped - skipped_before)

    def close(self) -> None:
        """Nothing is held open between polls."""

    def _read(self, path: Path) -> tuple[list[Signal], int]:
        start = self.offsets.get(path.name, 0)
        try:
            size = path.stat().st_size
            if size < start:
                start = 0  # truncated or replaced: read from the top again
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read(self.max_read_bytes)
        except OSError:
            return [], 0
        out: list[Signal] = []
        pos = 0
        lines = 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            lines += 1
            sig = self._parse(path.name, start + pos, data[pos:nl])
            if sig is not None:
                out.append(sig)
            pos = nl + 1
        self.offsets[path.name] = start + pos
        return out, lines

    def _job(self, rec: dict[str, object]) -> str:
        """The record's job; a hook that was given no name gets its pod's job, like the pod's log lines."""
        pod = rec.get("pod")
        if not rec.get("job_from_pod") or not isinstance(pod, str):
            return self.job or str(rec["job"])
        ns = str(rec.get("namespace") or "")
        key = (ns, pod)
        if key not in self._pod_jobs:
            labels = None
            if self.pod_metadata is not None:
                try:
                    labels = self.pod_metadata.labels(ns, pod, "")
                except Exception:
                    return pod_identity(pod, None, job=self.job)[0]  # not cached: the labels may come later
            self._pod_jobs[key] = pod_identity(pod, labels, job=self.job)[0]
        return self._pod_jobs[key]

    def _parse(self, name: str, offset: int, raw: bytes) -> Signal | None:
        try:
            rec = json.loads(raw)
            phases = {str(k): float(v) for k, v in dict(rec.get("phases") or {}).items()}
            st = rec.get("step_time")
            event = str(rec.get("event") or "step")
            if event not in ("step", "end"):
                raise ValueError(event)
            world = rec.get("world_size")
            sample = ProgressSample(job=self._job(rec), rank=int(rec["rank"]), step=int(rec["step"]),
                                    step_time=None if st is None else float(st), phases=phases, event=event,
                                    world_size=int(world) if isinstance(world, int) and world > 0 else None,
                                    namespace=str(rec["namespace"]) if rec.get("namespace") else None)
            ts = float(rec["ts"])
        except (ValueError, KeyError, TypeError, AttributeError):
            self.skipped += 1
            return None
        return Signal(id=f"{self.node}/progress/{name}/{offset}", node=self.node, source=Source.PROGRESS, ts=ts,
                      payload=sample)
