"""On-disk spool of batches the service could not take, replayed oldest first.

Each batch is one file holding exactly the gzip body that would have been
posted, written to a temporary name and renamed, so a crash never leaves a
half batch. The spool is bounded in bytes; past the cap the oldest batches are
dropped and their signals counted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"^(\d{20})-(\d+)\.json\.gz$")


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    """One batch waiting on disk."""

    path: Path
    """File holding the gzip-compressed JSON body."""
    seq: int
    """Order of arrival."""
    count: int
    """Signals in the batch."""


class DiskSpool:
    """Bounded FIFO of compressed batches in a directory."""

    def __init__(self, directory: Path, *, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.dropped_signals = 0
        """Signals lost because the spool was full (oldest dropped first)."""
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
                out.append(SpooledBatch(self.directory / entry, int(m.group(1)), int(m.group(2))))
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

    def put(self, body: bytes, count: int) -> None:
        """Append a batch durably, dropping the oldest ones past the cap."""
        seq = self._next_seq
        self._next_seq += 1
        path = self.directory / f"{seq:020d}-{count}.json.gz"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self._batches.append(SpooledBatch(path, seq, count))
        self._bytes += len(body)
        while self._bytes > self.max_bytes and len(self._batches) > 1:
            oldest = self._batches.pop(0)
            self._bytes -= self._size(oldest.path)
            oldest.path.unlink(missing_ok=True)
            self.dropped_signals += oldest.count

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
        if self._batches and self._batches[0] == batch:
            self._batches.pop(0)
        self._bytes -= self._size(batch.path)
        batch.path.unlink(missing_ok=True)
