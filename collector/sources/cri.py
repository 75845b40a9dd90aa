"""Container logs in the CRI format under ``/var/log/pods``.

Layout: ``<root>/<namespace>_<pod>_<uid>/<container>/<N>.log`` plus rotated
siblings; each line is ``<RFC3339Nano ts> <stdout|stderr> <P|F> <message>``.
``P`` marks a fragment of a longer line that continues in the next ``P``/``F``
line of the same stream, possibly in the next file after a rotation.
"""

from __future__ import annotations

import calendar
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from collector.identity import line_rank, pod_identity, strip_rank_prefix
from collector.podmeta import PodMetadataProvider
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.sources.base import Clock, Cursor, LinePrefilter, Poll
from collector.sources.tail import Chunk, RotatingFile, lines_of

MAX_LINE = 65536
"""Longest message shipped; the wire format refuses longer text."""

log = logging.getLogger(__name__)

METADATA_RETRY_S = 30.0
"""Seconds before a failed pod-label lookup is tried again."""

_LIVE = re.compile(r"^\d+\.log$")
_PARTIAL_MARKS = (b" stdout P ", b" stderr P ")


class TimestampParser:
    """RFC 3339 (nanosecond) timestamps; the whole-second part is cached."""

    def __init__(self) -> None:
        self._cache: dict[str, int] = {}

    def __call__(self, text: str) -> float | None:
        if len(text) < 20 or text[10] != "T":
            return None
        base = text[:19]
        secs = self._cache.get(base)
        if secs is None:
            try:
                secs = calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S"))
            except ValueError:
                return None
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[base] = secs
        rest = text[19:]
        frac = 0.0
        if rest.startswith("."):
            i = 1
            while i < len(rest) and rest[i].isdigit():
                i += 1
            frac = float("0" + rest[:i]) if i > 1 else 0.0
            rest = rest[i:]
        offset = 0
        if rest and rest[0] in "+-" and len(rest) >= 6:
            sign = 1 if rest[0] == "+" else -1
            offset = sign * (int(rest[1:3]) * 3600 + int(rest[4:6]) * 60)
        return secs + frac - offset


@dataclass(frozen=True, slots=True)
class PodRef:
    """A pod as named by its log directory."""

    namespace: str
    """Namespace (first part of the directory name)."""
    pod: str
    """Pod name."""
    uid: str
    """Pod UID."""

    @classmethod
    def parse(cls, dirname: str) -> PodRef | None:
        """``<ns>_<pod>_<uid>``: none of the three may contain ``_``."""
        parts = dirname.split("_")
        return cls(*parts) if len(parts) == 3 and all(parts) else None


@dataclass
class _Fragments:
    file_id: str
    offset: int
    ts: str
    parts: list[str] = field(default_factory=list)
    size: int = 0
    prefix: str | None = None


@dataclass
class _Stream:
    pod: PodRef
    container: str
    file: RotatingFile
    job: str | None = None
    rank: int | None = None
    partial: dict[str, _Fragments] = field(default_factory=dict)
    processed: dict[str, int] = field(default_factory=dict)
    safe: dict[str, int] = field(default_factory=dict)


class CriLogSource:
    """Tails every container log on the node."""

    name = "container"

    def __init__(
        self,
        *,
        node: str,
        root: Path = Path("/var/log/pods"),
        pod_metadata: PodMetadataProvider | None = None,
        prefilter: LinePrefilter | None = None,
        resume: Mapping[str, Cursor] | None = None,
        clock: Clock = time.time,
        max_bytes_per_file: int = 256 * 1024,
        job: str | None = None,
    ) -> None:
        self.node = node
        self.job = job
        self.root = root
        self.pod_metadata = pod_metadata
        self.prefilter = prefilter
        self.clock = clock
        self.max_bytes_per_file = max_bytes_per_file
        self.metadata_errors = 0
        self._resume = dict(resume or {})
        self._streams: dict[tuple[str, str, str], _Stream] = {}
        self._labels: dict[str, tuple[str | None, int | None] | None] = {}
        self._retry_at: dict[str, float] = {}
        self._emitted: dict[str, Cursor] = {}
        self._failing: set[tuple[str, str, str]] = set()
        self._ts = TimestampParser()
        self._filtered = 0

    def _pod_identity(self, pod: PodRef) -> tuple[str | None, int | None] | None:
        if pod.uid in self._labels:
            return self._labels[pod.uid]
        if self.pod_metadata is None:
            # Off-cluster without a labels file: the pod name says the job and the rank.
            ident = self._labels[pod.uid] = pod_identity(pod.pod, None, job=self.job)
            return ident
        if self._retry_at.get(pod.uid, 0.0) > self.clock():
            return None
        try:
            labels = self.pod_metadata.labels(pod.namespace, pod.pod, pod.uid)
        except Exception:
            # Retried later; logs keep flowing without job and rank meanwhile.
            self.metadata_errors += 1
            self._retry_at[pod.uid] = self.clock() + METADATA_RETRY_S
            return None
        ident = pod_identity(pod.pod, labels, job=self.job)
        self._labels[pod.uid] = ident
        return ident

    def _discover(self) -> set[tuple[str, str, str]]:
        seen: set[tuple[str, str, str]] = set()
        try:
            pod_dirs = os.listdir(self.root)
        except FileNotFoundError:
            return seen
        for pod_dir in pod_dirs:
            ref = PodRef.parse(pod_dir)
            if ref is None:
                continue
            try:
                containers = os.listdir(self.root / pod_dir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for container in containers:
                cdir = self.root / pod_dir / container
                try:
                    names = os.listdir(cdir)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for name in names:
                    if not _LIVE.match(name):
                        continue
                    key = (pod_dir, container, name)
                    seen.add(key)
                    if key not in self._streams:
                        self._streams[key] = _Stream(
                            ref, container,
                            RotatingFile(cdir, name, resume=self._resume,
                                         max_bytes=self.max_bytes_per_file),
                        )
        return seen

    def poll(self) -> Poll:
        """New lines from every container log, and the cursors they complete."""
        seen = self._discover()
        self._filtered = 0
        signals: list[Signal] = []
        cursors: dict[str, Cursor] = {}
        lines = errors = 0
        for key in list(self._streams):
            st = self._streams[key]
            if key not in seen:
                # Pod or container went away: its files are gone for good.
                for fp in st.file.positions:
                    cursors[fp] = None
                del self._streams[key]
                self._failing.discard(key)
                if st.job is not None and st.rank is not None:
                    # A rank of a known job is gone (completed and removed, or deleted): its silence
                    # from now on is no hang.
                    signals.append(Signal(f"{self.node}/container/{'/'.join(key)}/exit", self.node, Source.CONTAINER,
                                          self.clock(), ProgressSample(st.job, st.rank, 0, event="exit",
                                                                         namespace=st.pod.namespace or None)))
                continue
            if st.job is None and st.rank is None:
                ident = self._pod_identity(st.pod)
                if ident is not None:
                    st.job, st.rank = ident
            try:
                chunks, gone = st.file.read()
                for fp in gone:
                    cursors[fp] = None
                    st.safe.pop(fp, None)
                    st.processed.pop(fp, None)
                for chunk in chunks:
                    lines += chunk.data.count(b"\n")
                    self._process(st, chunk, signals)
                self._failing.discard(key)
            except Exception:
                # One unreadable file must not cost the other containers their lines. This
                # stream goes back to its last safe position and is read again next poll.
                errors += 1
                if key not in self._failing:
                    # Once per failing stream, not every poll; the error counter keeps counting.
                    log.exception("container log %s/%s failed", key[0], key[1])
                    self._failing.add(key)
                for fp, fpos in st.file.positions.items():
                    if fp in st.safe:
                        fpos.offset, fpos.complete = st.safe[fp], False
                st.partial.clear()
                st.processed = dict(st.safe)
            for fp, off in st.safe.items():
                pos = st.file.positions.get(fp)
                if pos is not None:
                    cursors[fp] = pos.cursor(off)
        # Only changed positions: an idle node should not rewrite its checkpoint every second.
        cursors = {fp: c for fp, c in cursors.items() if self._emitted.get(fp, ()) != c}
        for fp, c in cursors.items():
            if c is None:
                self._emitted.pop(fp, None)
            else:
                self._emitted[fp] = c
        live_pods = {k[0].split("_")[2] for k in self._streams}
        for uid in [u for u in self._labels if u not in live_pods]:
            del self._labels[uid]
        for uid in [u for u in self._retry_at if u not in live_pods]:
            del self._retry_at[uid]
        return Poll(signals, cursors, lines, errors=errors, filtered=self._filtered)

    def _process(self, st: _Stream, chunk: Chunk, out: list[Signal]) -> None:
        data = chunk.data
        slow = bool(st.partial) or any(m in data for m in _PARTIAL_MARKS)
        if not slow:
            kept = 0
            for offset, raw in lines_of(chunk, self.prefilter):
                kept += 1
                self._line(st, chunk.file_id, offset, raw, out, check=False)
            if self.prefilter is not None:
                self._filtered += data.count(b"\n") - kept
            st.processed[chunk.file_id] = chunk.offset + len(data)
            st.safe.update(st.processed)
            return
        pos = 0
        for raw in data.split(b"\n")[:-1]:
            offset = chunk.offset + pos
            pos += len(raw) + 1
            self._line(st, chunk.file_id, offset, raw, out, check=True)
            st.processed[chunk.file_id] = chunk.offset + pos
            if not st.partial:
                # Nothing pending: every file of the stream is done up to here.
                st.safe.update(st.processed)

    def _line(self, st: _Stream, fp: str, offset: int, raw: bytes, out: list[Signal], *, check: bool) -> None:
        text = raw.decode("utf-8", "replace")
        parts = text.split(" ", 3)
        if len(parts) < 3 or parts[2] not in ("P", "F") or parts[1] not in ("stdout", "stderr"):
            self._emit(st, fp, offset, None, text, out, check)
            return
        ts, stream, tag = parts[0], parts[1], parts[2]
        msg = parts[3] if len(parts) == 4 else ""
        frag = st.partial.get(stream)
        if tag == "P":
            if frag is None:
                frag = st.partial[stream] = _Fragments(fp, offset, ts)
            if "\r" in msg:
                self._bar_update(st, fp, offset, ts, frag, msg, out)
            elif frag.size < MAX_LINE:
                frag.parts.append(msg)
                frag.size += len(msg)
            return
        if frag is not None:
            del st.partial[stream]
            frag.parts.append(msg)
            self._emit(st, frag.file_id, frag.offset, frag.ts, (frag.prefix or "") + "".join(frag.parts), out, True)
            return
        self._emit(st, fp, offset, ts, msg, out, check)

    def _bar_update(self, st: _Stream, fp: str, offset: int, ts: str, frag: _Fragments, msg: str,
                    out: list[Signal]) -> None:
        """A progress bar redraws itself with carriage returns and never ends its line, so the
        runtime hands it over in partial records: ship the latest complete redraw now (a bar
        that only arrived with its final newline would look like a stalled job for a whole epoch)
        and keep only the redraw in progress."""
        segments = ("".join(frag.parts) + msg).split("\r")
        if frag.prefix is None:
            # The launcher's rank prefix starts the line, not each redraw: carry it over.
            frag.prefix = segments[0][:len(segments[0]) - len(strip_rank_prefix(segments[0]))]
        latest = next((seg for seg in reversed(segments[:-1]) if seg.strip()), None)
        if latest is not None:
            # Its own id: the record's offset is also where the joined line would be reported from.
            self._emit(st, fp, offset, ts, frag.prefix + strip_rank_prefix(latest), out, True, suffix="r")
        frag.parts = [segments[-1]]
        frag.size = len(segments[-1])

    def _emit(
        self, st: _Stream, fp: str, offset: int, ts: str | None, text: str, out: list[Signal], check: bool,
        *, suffix: str = "",
    ) -> None:
        if check and self.prefilter is not None and not self.prefilter.matches(text):
            self._filtered += 1
            return
        if len(text) > MAX_LINE:
            text = text[:MAX_LINE]
        # Several ranks may share one pod's stdout: the line's own prefix names the writer.
        prefixed = line_rank(text)
        rank = prefixed if prefixed is not None else st.rank
        when = self._ts(ts) if ts else None
        out.append(Signal(
            id=f"{self.node}/container/{fp}/{offset}{suffix}",
            node=self.node,
            source=Source.CONTAINER,
            ts=when if when is not None else self.clock(),
            payload=LogLine(text, st.pod.namespace, st.pod.pod, st.container, st.job, rank),
        ))

    def close(self) -> None:
        """Nothing is held open between polls."""
        self._streams.clear()
