"""`bench/fleet.py` end to end on a small fleet and a real PostgreSQL: one JSON object, no signal lost, one
incident per injected fault, the leader's figures present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_fleet_benchmark_loses_nothing_and_makes_one_incident_per_fault(postgres_url: str) -> None:
    proc = subprocess.run([sys.executable, "bench/fleet.py", "--database-url", postgres_url, "--nodes", "192",
                           "--windows", "2", "--faults", "3", "--replicas", "3"],
                          capture_output=True, text=True, cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["no_signal_lost"] and r["signals_accepted"] == r["signals_sent"] > 0, r
    assert r["ranks_at_leader"] == 192 * 8 and r["log_lines_stored"] == r["log_lines_sent"], r
    assert r["one_incident_per_fault"] and len(r["incidents"]) == 3, r
    assert r["leader_cpu_s"] > 0 and r["leader_peak_rss_mb"] > 0, r
