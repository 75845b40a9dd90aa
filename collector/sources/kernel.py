"""Kernel log: ``/dev/kmsg`` records, or ``kern.log``-style files as an alternative.

A ``/dev/kmsg`` record is ``<pri>,<seq>,<usec>,<flags>[,...];<message>`` followed
by continuation lines that start with a space (``KEY=value``); the flags say whether the record is a
piece of a line printed with ``pr_cont`` (``c``, then ``+``), which is joined back. Each ``read()``
on the device returns one record; when the ring buffer overwrote records the
reader had not seen, ``read()`` fails once with EPIPE and reading goes on from
the oldest record still there. Sequence numbers restart at boot, so ids and
checkpoints carry the boot id.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from collector.normalize import group_events, may_continue, prefix_lengths, without_prefixes
from collector.signal import LogLine, Signal, Source
from collector.sources.base import Clock, Cursor, LinePrefilter, Poll
from collector.sources.cri import TimestampParser
from collector.sources.tail import RotatingFile

_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    """One parsed ``/dev/kmsg`` record."""

    priority: int
    """Syslog priority: facility * 8 + level."""
    seq: int
    """Kernel sequence number, increasing by one per record since boot."""
    usec: int
    """Monotonic timestamp in microseconds since boot."""
    message: str
    """Message text with ``\\xNN`` escapes decoded."""
    fields: Mapping[str, str]
    """Continuation ``KEY=value`` pairs (``SUBSYSTEM``, ``DEVICE``)."""
    flag: str = "-"
    """``-`` for a whole line; ``c`` for a line's first fragment and ``+`` for its later ones (kernels before
    4.9 stored each ``pr_cont`` piece as a record of its own; later ones flag assembled lines ``c``)."""

    @property
    def continues(self) -> bool:
        """The record is a fragment of a line whose later fragments may follow."""
        return self.flag in ("c", "+")

    @property
    def level(self) -> int:
        """Log level 0 (emerg) .. 7 (debug)."""
        return self.priority & 7


def parse_records(data: bytes) -> list[KmsgRecord]:
    """Records in a buffer holding one or more whole records."""
    out: list[KmsgRecord] = []
    head: str | None = None
    fields: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").split("\n"):
        if line.startswith(" "):
            key, _, value = line[1:].partition("=")
            fields[key] = value
            continue
        if head is not None:
            rec = _record(head, fields)
            if rec is not None:
                out.append(rec)
        head, fields = (line if line else None), {}
    if head is not None:
        rec = _record(head, fields)
        if rec is not None:
            out.append(rec)
    return out


def _record(head: str, fields: dict[str, str]) -> KmsgRecord | None:
    prefix, sep, message = head.partition(";")
    parts = prefix.split(",")
    if not sep or len(parts) < 3:
        return None
    try:
        pri, seq, usec = int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        return None
    if "\\x" in message:
        message = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), message)
    flag = parts[3][:1] if len(parts) > 3 and parts[3] else "-"
    return KmsgRecord(pri, seq, usec, message, fields, flag)


def kernel_events(records: Sequence[KmsgRecord]) -> list[tuple[int, str]]:
    """The events of consecutive records: (index of the first record, text), the way ``kmend analyze``
    folds the same lines (an AER report with its status/mask and bit lines, a split NVRM message).

    A record holding several lines is read as dmesg prints it: its later lines indented under the
    first. An event of one single-line record keeps its message as the kernel wrote it.
    """
    if not records:
        return []
    messages = _joined_fragments(records)
    texts: list[str] = []
    prefixed: list[bool] = []
    owner: list[int] = []
    for k, message in messages.items():
        first, *rest = message.split("\n")
        texts.append(first)
        prefixed.append(True)
        owner.append(k)
        for more in rest:
            texts.append(_CONTINUATION + more)
            prefixed.append(False)
            owner.append(k)
    grouped = group_events(texts, texts, prefixed)
    out: list[tuple[int, str]] = []
    for n, head in enumerate(grouped.lines):
        nxt = grouped.lines[n + 1] if n + 1 < len(grouped.lines) else len(texts)
        first_rec, last_rec = owner[head], owner[nxt - 1]
        if out and out[-1][0] == first_rec:
            # A record's later line the fold left on its own is still part of its record's signal.
            out[-1] = (first_rec, out[-1][1] + " " + grouped.texts[n].strip())
            continue
        single = first_rec == last_rec and "\n" not in messages[first_rec]
        out.append((first_rec, messages[first_rec] if single else grouped.texts[n]))
    return out


def _joined_fragments(records: Sequence[KmsgRecord]) -> dict[int, str]:
    """Each line's message by the index of its first record: a ``+`` fragment after a ``c`` or ``+`` one is
    the rest of that line (pieces carry their own spacing, so they join with nothing between)."""
    out: dict[int, str] = {}
    head = -1
    for k, rec in enumerate(records):
        if rec.flag == "+" and head >= 0 and records[k - 1].continues:
            out[head] += rec.message
            continue
        head = k
        out[k] = rec.message
    return out


_CONTINUATION = " " * 16
"""How dmesg indents the later lines of a multi-line record (under the message, past the stamp)."""


class KmsgReader(Protocol):
    """Reads ``/dev/kmsg``.

    Guarantees: ``read`` never blocks; it returns one or more whole records,
    ``b""`` at end of data, raises ``BlockingIOError`` when no record is ready
    and ``BrokenPipeError`` when records were overwritten before being read.
    """

    def read(self) -> bytes:
        """The next record(s)."""
        ...

    def close(self) -> None:
        """Release the descriptor."""
        ...


class DeviceKmsgReader:
    """Non-blocking reader of the kmsg device (or a fixture file)."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def read(self) -> bytes:
        """The next record(s); the device returns one per call."""
        return os.read(self._fd, 16384)

    def close(self) -> None:
        """Release the descriptor."""
        os.close(self._fd)


class KmsgSource:
    """Kernel messages from ``/dev/kmsg``."""

    name = "kernel"

    def __init__(
        self,
        *,
        node: str,
        path: Path = Path("/dev/kmsg"),
        boot_id_path: Path = Path("/proc/sys/kernel/random/boot_id"),
        open_reader: Callable[[Path], KmsgReader] = DeviceKmsgReader,
        resume: Mapping[str, Cursor] | None = None,
        prefilter: LinePrefilter | None = None,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        max_records: int = 5000,
        hold_s: float = 1.0,
    ) -> None:
        self.node = node
        self.path = path
        self.hold_s = hold_s
        """Longest a record that may open a multi-record event waits for the rest of it (kernel time)."""
        self._held: list[KmsgRecord] = []
        self.prefilter = prefilter
        self.clock = clock
        self.monotonic = monotonic
        self.max_records = max_records
        self.overruns = 0
        """Times the ring buffer overwrote records before they were read."""
        try:
            self.boot = boot_id_path.read_text().strip()
        except OSError:
            self.boot = "unknown"
        saved = dict(resume or {}).get("position")
        self.last_seq = -1
        if isinstance(saved, dict) and saved.get("boot") == self.boot:
            self.last_seq = int(saved.get("seq", -1))
        self._reader = open_reader(path)

    def poll(self) -> Poll:
        """Events of the records appended since the previous call (at most ``max_records`` records).

        The lines of one PCIe AER report, and an NVRM message the kernel split over records, are one
        event: one signal, whose id is its first record's. The last event is held back while it may
        still grow (a report is printed over a few milliseconds, a poll can end inside it) and for at
        most ``hold_s`` of kernel time; the checkpoint never passes a record held back.
        """
        records = self._held
        count = filtered = 0
        overruns = self.overruns
        boot_epoch = self.clock() - self.monotonic()
        while count < self.max_records:
            try:
                data = self._reader.read()
            except BrokenPipeError:
                self.overruns += 1
                continue
            except BlockingIOError:
                break
            if not data:
                break
            for rec in parse_records(data):
                count += 1
                if rec.seq <= self.last_seq:
                    continue
                self.last_seq = rec.seq
                records.append(rec)
        events = kernel_events(records)
        self._held = []
        if events and self.hold_s > 0:
            first, text = events[-1]
            if ((may_continue(text) or records[-1].continues)
                    and self.monotonic() - records[-1].usec / 1e6 < self.hold_s):
                self._held = records[first:]
                events.pop()
        signals: list[Signal] = []
        for first, text in events:
            if self.prefilter is not None and not self.prefilter.matches(text):
                filtered += 1
                continue
            head = records[first]
            signals.append(Signal(
                id=f"{self.node}/kernel/{self.boot}/{head.seq}",
                node=self.node,
                source=Source.KERNEL,
                ts=boot_epoch + head.usec / 1e6,
                payload=LogLine(text),
            ))
        cursors: dict[str, Cursor] = {}
        if count or records:
            done = self._held[0].seq - 1 if self._held else self.last_seq
            cursors["position"] = {"boot": self.boot, "seq": done}
        return Poll(signals, cursors, count, self.overruns - overruns, filtered=filtered)

    def close(self) -> None:
        """Release the device."""
        self._reader.close()




@dataclass(slots=True)
class _Held:
    """The lines of a kern.log event that may still grow, kept back for the next poll."""

    file_id: str
    """File they were read from."""
    offset: int
    """Offset of their first byte in that file."""
    data: bytes
    """The lines, each ending in a newline."""
    since: float
    """When they were first held (wall clock)."""


class KernLogSource:
    """Kernel messages from a syslog file such as ``/var/log/kern.log``, across rotation.

    Multi-line events are folded as ``kmend analyze`` and the ``/dev/kmsg`` source fold them (a PCIe
    AER report with its status, mask and bit lines; an NVRM message split over lines): one event, one
    signal, whose id is its first line's offset. An event at the end of what was read, which the next
    lines may still extend, is held back for at most ``hold_s`` and the checkpoint stays before it.
    """

    name = "kernel"

    def __init__(
        self,
        *,
        node: str,
        path: Path = Path("/var/log/kern.log"),
        resume: Mapping[str, Cursor] | None = None,
        prefilter: LinePrefilter | None = None,
        clock: Clock = time.time,
        max_bytes: int = 256 * 1024,
        hold_s: float = 1.0,
    ) -> None:
        self.node = node
        self.prefilter = prefilter
        self.clock = clock
        self.hold_s = hold_s
        """Longest an event that may continue waits for its next lines (wall clock)."""
        self._file = RotatingFile(path.parent, path.name, resume=resume, max_bytes=max_bytes)
        self._ts = TimestampParser()
        self._held: _Held | None = None

    def poll(self) -> Poll:
        """Events of the lines appended since the previous call."""
        chunks, gone = self._file.read()
        cursors: dict[str, Cursor] = {fp: None for fp in gone}
        signals: list[Signal] = []
        lines = events = 0
        now = self.clock()
        held, self._held = self._held, None
        for n, chunk in enumerate(chunks):
            lines += chunk.data.count(b"\n")
            offset, data, since = chunk.offset, chunk.data, now
            if held is not None and held.file_id == chunk.file_id and held.offset + len(held.data) == chunk.offset:
                offset, data, since = held.offset, held.data + data, held.since
            elif held is not None:
                events += self._emit(held.file_id, held.offset, held.data, signals)
            held = None
            # Only the newest lines read may still grow: an older file's or chunk's last event is whole.
            last = n == len(chunks) - 1
            events += self._emit(chunk.file_id, offset, data, signals, hold_since=since if last else None)
            start = self._held.offset if self._held is not None and self._held.file_id == chunk.file_id else None
            cursors[chunk.file_id] = self._file.positions[chunk.file_id].cursor(start)
        if held is not None:  # nothing new: the held event is emitted, or waits a little longer
            events += self._emit(held.file_id, held.offset, held.data, signals, hold_since=held.since)
            if self._held is None and held.file_id in self._file.positions:
                cursors[held.file_id] = self._file.positions[held.file_id].cursor()
        filtered = events - len(signals) if self.prefilter is not None else 0
        return Poll(signals, cursors, lines, filtered=filtered)

    def _emit(self, file_id: str, offset: int, data: bytes, out: list[Signal], *,
              hold_since: float | None = None) -> int:
        """Signals of the events in ``data`` (whole lines of one file) into ``out``; returns how many events.

        ``hold_since``: the lines are the newest read; their last event is held back when it may continue
        and has waited less than ``hold_s`` since then.
        """
        parts = data.split(b"\n")[:-1]
        starts = list(itertools.accumulate(map(len, parts[:-1]), lambda at, n: at + n + 1, initial=0))
        raw = [p.decode("utf-8", "replace") for p in parts]
        lengths = prefix_lengths(raw)
        grouped = group_events(without_prefixes(raw, lengths), raw, list(map(bool, lengths)))
        heads, texts = grouped.lines, grouped.texts
        if (hold_since is not None and heads and self.hold_s > 0 and may_continue(texts[-1])
                and self.clock() - hold_since < self.hold_s):
            cut = starts[heads[-1]]
            self._held = _Held(file_id, offset + cut, data[cut:], hold_since)
            heads, texts = heads[:-1], texts[:-1]
        for head, text in zip(heads, texts, strict=True):
            if self.prefilter is not None and not self.prefilter.matches(text):
                continue
            ts = self._ts(raw[head].split(" ", 1)[0])
            out.append(Signal(
                id=f"{self.node}/kernel/{file_id}/{offset + starts[head]}",
                node=self.node,
                source=Source.KERNEL,
                ts=ts if ts is not None else self.clock(),
                payload=LogLine(text),
            ))
        return len(heads)

    def close(self) -> None:
        """Nothing is held open between polls."""
