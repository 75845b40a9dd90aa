"""Helpers for agent tests: writing CRI log lines and rotating files like kubelet and logrotate."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from collector.signal import Signal

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agent"


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
