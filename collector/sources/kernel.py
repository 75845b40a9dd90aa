"""Kernel log: ``/dev/kmsg`` records, or ``kern.log``-style files as an alternative.

A ``/dev/kmsg`` record is ``<pri>,<seq>,<usec>,<flags>[,...];<message>`` followed
by continuation lines that start with a space (``KEY=value``). Each ``read()``
on the device returns one record; when the ring buffer overwrote records the
reader had not seen, ``read()`` fails once with EPIPE and reading goes on from
the oldest record still there. Sequence numbers restart at boot, so ids and
checkpoints carry the boot id.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from collector.normalize import group_events, may_continue, strip_prefix
from collector.signal import LogLine, Signal, Source
from collector.sources.base import Clock, Cursor, LinePrefilter, Poll
from collector.sources.cri import TimestampParser
from collector.sources.tail import RotatingFile, lines_of

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
    return KmsgRecord(pri, seq, usec, message, fields)


def kernel_events(records: Sequence[KmsgRecord]) -> list[tuple[int, str]]:
    """The events of consecutive records: (index of the first record, text), the way ``kmend analyze``
    folds the same lines (an AER report with its status/mask and bit lines, a split NVRM message).

    An event of one record keeps its message as the kernel wrote it.
    """
    if not records:
        return []
    texts = [r.message.replace("\n", " ") for r in records]
    # Every record is a whole line: none is the wrapped rest of the one before it.
    grouped = group_events(texts, texts, [True] * len(texts))
    out: list[tuple[int, str]] = []
    for k, first in enumerate(grouped.lines):
        last = grouped.lines[k + 1] - 1 if k + 1 < len(grouped.lines) else len(records) - 1
        out.append((first, records[first].message if first == last else grouped.texts[k]))
    return out


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
            if may_continue(text) and self.monotonic() - records[-1].usec / 1e6 < self.hold_s:
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




class KernLogSource:
    """Kernel messages from a syslog file such as ``/var/log/kern.log``, across rotation."""

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
    ) -> None:
        self.node = node
        self.prefilter = prefilter
        self.clock = clock
        self._file = RotatingFile(path.parent, path.name, resume=resume, max_bytes=max_bytes)
        self._ts = TimestampParser()

    def poll(self) -> Poll:
        """Lines appended since the previous call."""
        chunks, gone = self._file.read()
        cursors: dict[str, Cursor] = {fp: None for fp in gone}
        signals: list[Signal] = []
        lines = 0
        for chunk in chunks:
            lines += chunk.data.count(b"\n")
            for offset, raw in lines_of(chunk, self.prefilter):
                line = raw.decode("utf-8", "replace")
                # RFC 3164/5424, journald short-iso/precise and dmesg stamps: the rules see the message.
                text = line[strip_prefix(line).length:]
                ts = self._ts(line.split(" ", 1)[0])
                signals.append(Signal(
                    id=f"{self.node}/kernel/{chunk.file_id}/{offset}",
                    node=self.node,
                    source=Source.KERNEL,
                    ts=ts if ts is not None else self.clock(),
                    payload=LogLine(text),
                ))
            cursors[chunk.file_id] = self._file.positions[chunk.file_id].cursor()
        return Poll(signals, cursors, lines, filtered=lines - len(signals) if self.prefilter is not None else 0)

    def close(self) -> None:
        """Nothing is held open between polls."""

