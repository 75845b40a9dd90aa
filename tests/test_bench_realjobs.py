"""`bench/realjobs.py` end to end on one short healthy DDP job: one JSON object with the steps seen and what kmend
raised, the job's lines kept as evidence, and nothing left behind (no process, no temporary directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.realjob, pytest.mark.timeout(120)]


def _running_under(path: Path) -> list[str]:
    """Command lines of the processes that name `path` (the service's database, the agent's state)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(path) in cmd:
            out.append(cmd)
    return out


def test_a_short_healthy_ddp_job_is_watched_reported_and_cleaned_up(tmp_path: Path) -> None:
    tmp, evidence = tmp_path / "tmp", tmp_path / "evidence"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "bench/realjobs.py", "--jobs", "ddp", "--seconds", "4",
                           "--evidence", str(evidence)], capture_output=True, text=True, cwd=REPO, timeout=110,
                          env={**os.environ, "TMPDIR": str(tmp)}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    [job] = out["jobs"]
    assert job["job"] == "ddp" and job["world"] == 4 and job["steps"] > 0 and job["seconds"] >= 4.0, job
    assert out["job_hours"] > 0 and out["false_findings"] == sum(job["findings"].values())
    kept = json.loads((evidence / "ddp-load0-run0" / "result.json").read_text())
    assert len(kept["arrivals"]) == 4 and all(kept["arrivals"].values())
    assert list(tmp.iterdir()) == []
    assert _running_under(tmp) == []
