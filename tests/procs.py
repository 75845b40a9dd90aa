"""Waiting for a `kmend serve` child to be ready: long enough for a loaded CI machine, and failing at once,
with the child's log, when the child has died instead."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

READY_TIMEOUT_S = 180.0
"""A cold start takes about 2 s; a 2-core CI machine running other test workers can take far longer."""


def wait_ready(url: str, proc: subprocess.Popen[bytes], *, log: Path | None = None,
               timeout: float = READY_TIMEOUT_S) -> None:
    """Return once ``url/readyz`` answers 200; raise with the log's tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"kmend exited with {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready within {timeout:.0f} s")
