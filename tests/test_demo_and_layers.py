"""`kmend demo --json` end to end as a user runs it, and the import-layer contracts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def test_demo_detects_and_heals_the_injected_xid79() -> None:
    out = subprocess.run([_bin("kmend"), "demo", "--json"], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["healed"] is True and summary["seconds"] < 60
    [inc] = summary["incidents"]
    assert inc["fault_class"] == "gpu_lost" and inc["root_cause"]["node"] == "gpu-node-05"
    # The stall the lost GPU caused is seen by the hang detector and folds into the same incident.
    assert inc["findings_by_rule"] == {"xid-79": 1, "nccl-watchdog-timeout": 64, "hang-detector": 1}
    kinds = {(a["kind"], a["node"], a["result"]) for a in summary["actions"]}
    assert {("cordon", "gpu-node-05", "succeeded"), ("taint", "gpu-node-05", "succeeded")} <= kinds
    assert summary["nodes"]["by_state"] == {"healthy": 15, "quarantined": 1}


def test_import_layers_hold() -> None:
    """collector → analyzer → healer one way; analyzer pure; only the adapter imports kubernetes."""
    out = subprocess.run([_bin("lint-imports")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout and "KEPT" in out.stdout
