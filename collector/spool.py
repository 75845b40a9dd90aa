"""On-disk spool of batches the service could not take, replayed oldest first.

Each batch is one file holding exactly the gzip body that would have been
posted, written to a temporary name and renamed, so a crash never leaves a
half batch. The spool is bounded in bytes. Each batch carries a value
(``Value``): past the cap, the least valuable batches go first (progress and
metrics before log lines, symptoms before causes), oldest first within a value,
and every dropped signal is counted by its value. A batch is never stored by
dropping one worth as much or more: ``put`` refuses it, and the agent then
keeps the lines in their files (read positions do not advance) until the
service is back.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

_NAME = re.compile(r"^(\d{20})-(\d+)(?:-v(\d))?\.json\.gz$")


class Value(IntEnum):
    """How much a batch is worth keeping through an outage; higher is kept longer."""

    TELEMETRY = 0
    """Progress and metric samples: a gap in them costs a few minutes of history."""
    SYMPTOM = 1
    """Log lines a rule may match that are not known causes (NCCL timeouts, tracebacks)."""
    CAUSE = 2
    """Lines that name a cause (an Xid, a PCIe or NIC fault): the root of the incident."""


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    """One batch waiting on disk."""

    path: Path
    """File holding the gzip-compressed JSON body."""
    seq: int
    """Order of arrival."""
    count: int
    """Signals in the batch."""
    value: Value = Value.SYMPTOM
    """What it is worth (batches spooled before values existed count as symptoms)."""


class DiskSpool:
    """Bounded FIFO of compressed batches in a directory."""

    def __init__(self, directory: Path, *, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.dropped_signals = 0
        """Signals lost because the spool was full (least valuable, then oldest, first)."""
        self.dropped_by_value: Counter[Value] = Counter()
        """The same, by value."""
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        self._batches = sorted(self._scan(), key=lambda b: b.seq)
        self._bytes = sum(self._size(b.path) for b in self._batches)
        self._next_seq = (self._batches[-1].seq + 1) if self._batches else 0

    def _scan(self) -> list[SpooledBatch]:
        out = []
        for entry in os.listdir(self.directory):
            m = _NAME.match(entry)
            if m:
                value = Value(int(m.group(3))) if m.group(3) else Value.SYMPTOM
                out.append(SpooledBatch(self.directory / entry, int(m.group(1)), int(m.group(2)), value))
        return out

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def size_bytes(self) -> int:
        """Bytes on disk."""
        return self._bytes

    @property
    def signals(self) -> int:
        """Signals waiting."""
        return sum(b.count for b in self._batches)

    def put(self, body: bytes, count: int, value: Value = Value.SYMPTOM) -> bool:
        """Append a batch durably, making room by dropping less valuable batches; False when it cannot be kept.

        Telemetry that does not fit is dropped and counted (True: the caller moves on). A batch of
        log lines that does not fit without dropping lines worth as much is refused (False) and
        nothing is written: the caller keeps it where it came from.
        """
        need = len(body)
        while self._bytes + need > self.max_bytes:
            cheaper = [b for b in self._batches if b.value < value]
            if not cheaper:
                break
            self._drop(min(cheaper, key=lambda b: (b.value, b.seq)))
        if self._bytes + need > self.max_bytes and self._batches:
            if value == Value.TELEMETRY:
                self.dropped_signals += count
                self.dropped_by_value[value] += count
                return True
            return False
        seq = self._next_seq
        self._next_seq += 1
        path = self.directory / f"{seq:020d}-{count}-v{int(value)}.json.gz"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self._batches.append(SpooledBatch(path, seq, count, value))
        self._bytes += len(body)
        return True

    def _drop(self, batch: SpooledBatch) -> None:
        self._batches.remove(batch)
        self._bytes -= self._size(batch.path)
        batch.path.unlink(missing_ok=True)
        self.dropped_signals += batch.count
        self.dropped_by_value[batch.value] += batch.count

    def peek(self) -> SpooledBatch | None:
        """The oldest batch, if any."""
        return self._batches[0] if self._batches else None

    def read(self, batch: SpooledBatch) -> bytes:
        """A batch's body."""
        return batch.path.read_bytes()

    @property
    def quarantine_dir(self) -> Path:
        """Where batches the service refused as malformed are set aside (never retried)."""
        return self.directory / "quarantine"

    def quarantine(self, body: bytes, count: int, *, keep: int = 16) -> Path:
        """Set a refused batch aside for inspection, keeping only the newest `keep`."""
        q = self.quarantine_dir
        q.mkdir(exist_ok=True)
        seq = max((int(m.group(1)) for e in os.listdir(q) if (m := _NAME.match(e))), default=-1) + 1
        path = q / f"{seq:020d}-{count}.json.gz"
        path.write_bytes(body)
        for old in sorted(e for e in os.listdir(q) if _NAME.match(e))[:-keep]:
            (q / old).unlink(missing_ok=True)
        return path

    def quarantine_batch(self, batch: SpooledBatch) -> None:
        """Move a spooled batch the service refused into quarantine."""
        self.quarantine(self.read(batch), batch.count)
        self.pop(batch)

    def pop(self, batch: SpooledBatch) -> None:
        """Remove a batch once it was delivered."""
        if batch in self._batches:
            self._batches.remove(batch)
        self._bytes -= self._size(batch.path)
        batch.path.unlink(missing_ok=True)
