"""Following one log file across rotation: by rename, by copytruncate, and into ``.gz``.

A file is known by a fingerprint of its first line, not by name or inode:
the name moves on rename, the inode stays on copytruncate while the content
starts over, and a compressed copy gets a new inode but the same first line.
Read offsets are kept per fingerprint (offsets into the decompressed stream
for ``.gz``), so a rotated file is finished from where reading stopped and a
restarted agent resumes each file exactly where it was checkpointed.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from collector.sources.base import Cursor, LinePrefilter

FINGERPRINT_BYTES = 256
"""How much of the first line identifies a file."""


def fingerprint(path: Path, *, gz: bool = False) -> str | None:
    """Identity of a file from its first line; ``None`` while it has no complete first line."""
    opener = gzip.open if gz else open
    with opener(path, "rb") as fh:
        head = fh.read(FINGERPRINT_BYTES)
    nl = head.find(b"\n")
    if nl < 0 and len(head) < FINGERPRINT_BYTES:
        return None
    key = head[: nl + 1] if nl >= 0 else head
    return hashlib.blake2b(key, digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Chunk:
    """Complete lines read from one file."""

    file_id: str
    """Fingerprint of the file they come from."""
    offset: int
    """Offset of the first byte of ``data`` in the (decompressed) file."""
    data: bytes
    """Whole lines, each ending in a newline."""


@dataclass(slots=True)
class FilePosition:
    """How far one file has been read."""

    offset: int
    """Next byte to read."""
    complete: bool = False
    """The file is a finished ``.gz`` read to its end; it is not opened again."""

    def cursor(self, offset: int | None = None) -> Cursor:
        """JSON form for the checkpoint, optionally held back to ``offset``."""
        off = self.offset if offset is None else offset
        return {"offset": off, "complete": self.complete and off == self.offset}


def lines_of(chunk: Chunk, prefilter: LinePrefilter | None) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of a chunk's lines; with a prefilter only the candidate lines."""
    data = chunk.data
    if prefilter is None:
        pos = 0
        for line in data.split(b"\n")[:-1]:
            yield chunk.offset + pos, line
            pos += len(line) + 1
        return
    last_start = -1
    for end in prefilter.scan(data):
        # A match ending exactly on a newline belongs to the line before it.
        probe = end - 1 if end > 0 and data[end - 1 : end] == b"\n" else end
        start = data.rfind(b"\n", 0, probe) + 1
        if start == last_start:
            continue
        last_start = start
        stop = data.find(b"\n", start)
        yield chunk.offset + start, data[start:stop]


class RotatingFile:
    """A live log file plus its rotated siblings, read oldest first."""

    def __init__(
        self,
        directory: Path,
        live_name: str,
        *,
        resume: Mapping[str, Cursor] | None = None,
        max_bytes: int = 256 * 1024,
    ) -> None:
        self.directory = directory
        self.live_name = live_name
        self.max_bytes = max_bytes
        self.positions: dict[str, FilePosition] = {}
        self._resume = dict(resume or {})
        self._fp_cache: dict[tuple[int, int, int, int], str] = {}

    def _is_member(self, name: str) -> bool:
        if name == self.live_name:
            return True
        # kubelet compresses into "<name>.gz.tmp" and renames when done.
        return name.startswith(self.live_name + ".") and not name.endswith(".tmp")

    def _files(self) -> list[tuple[Path, os.stat_result, bool]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        found: list[tuple[Path, os.stat_result, bool]] = []
        for name in names:
            if not self._is_member(name):
                continue
            path = self.directory / name
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((path, st, name == self.live_name))
        found.sort(key=lambda f: (f[2], f[1].st_mtime_ns, f[0].name))
        return found

    def _identity(self, path: Path, st: os.stat_result, live: bool, gz: bool) -> str | None:
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if not live and key in self._fp_cache:
            return self._fp_cache[key]
        try:
            fp = fingerprint(path, gz=gz)
        except (FileNotFoundError, EOFError, gzip.BadGzipFile):
            return None
        if fp is not None and not live:
            if len(self._fp_cache) > 64:
                self._fp_cache.clear()
            self._fp_cache[key] = fp
        return fp

    def _position(self, fp: str) -> FilePosition:
        pos = self.positions.get(fp)
        if pos is None:
            saved = self._resume.pop(fp, None)
            if isinstance(saved, dict):
                pos = FilePosition(int(saved.get("offset", 0)), bool(saved.get("complete", False)))
            else:
                pos = FilePosition(0)
            self.positions[fp] = pos
        return pos

    def read(self) -> tuple[list[Chunk], list[str]]:
        """New complete lines, oldest file first, and the fingerprints that vanished."""
        chunks: list[Chunk] = []
        budget = self.max_bytes
        present: set[str] = set()
        for path, st, live in self._files():
            gz = path.name.endswith(".gz")
            fp = self._identity(path, st, live, gz)
            if fp is None:
                continue
            present.add(fp)
            pos = self._position(fp)
            if pos.complete or budget <= 0 or (not gz and st.st_size <= pos.offset):
                continue
            try:
                data, at_eof = _read_at(path, pos.offset, budget, gz=gz)
            except (FileNotFoundError, EOFError, gzip.BadGzipFile):
                continue
            cut = data.rfind(b"\n") + 1
            synthetic = 0
            if gz and at_eof and cut < len(data):
                # A compressed file is final: its unterminated last line is a line.
                data += b"\n"
                cut, synthetic = len(data), 1
            if cut:
                chunks.append(Chunk(fp, pos.offset, data[:cut]))
                pos.offset += cut - synthetic
                budget -= cut
            if gz and at_eof:
                pos.complete = True
        gone = [fp for fp in self.positions if fp not in present]
        for fp in gone:
            del self.positions[fp]
        return chunks, gone


def _read_at(path: Path, offset: int, limit: int, *, gz: bool) -> tuple[bytes, bool]:
    if gz:
        with gzip.open(path, "rb") as zfh:
            zfh.seek(offset)
            data = zfh.read(limit + 1)
        at_eof = len(data) <= limit
        return data[:limit], at_eof
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read(limit)
    return data, False
