"""Waiting for a `kmend serve` child to be ready: long enough for a loaded CI machine, and failing at once,
with the child's log, when the child has died instead."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

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


ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
"""Debian's Alertmanager binary (.ci/run installs it), or None."""


@contextlib.contextmanager
def alertmanager(tmp_path: Path, config: dict[str, Any], port: int,
                 timeout: float = READY_TIMEOUT_S) -> Iterator[str]:
    """A real Alertmanager on 127.0.0.1:`port` with `config`; yields its URL once /-/ready answers."""
    assert ALERTMANAGER is not None
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(yaml.safe_dump(config))
    log = tmp_path / "am.log"
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={cfg}", f"--storage.path={tmp_path / 'am'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "alertmanager did not become ready"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
