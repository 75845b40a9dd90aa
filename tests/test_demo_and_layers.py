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
    # The whole replace-node runbook ran, each step once, in order.
    steps = [(a["kind"], a["result"]) for a in summary["actions"]]
    assert steps == [(k, "succeeded") for k in ("evidence", "cordon", "taint", "label", "condition", "event", "drain",
                                                "spare_swap", "checkpoint", "restart_job", "repair", "validate",
                                                "return")]
    assert {a["node"] for a in summary["actions"]} == {"gpu-node-05"}
    # The job runs again on eight healthy nodes, one of them a spare, from the last complete checkpoint.
    job = summary["job"]
    assert len(job["nodes"]) == 8 and not job["on_failed_node"] and job["spare"] in ("gpu-node-14", "gpu-node-15")
    assert job["resume_from"].endswith("checkpoint-20")  # checkpoint-40 was cut short while writing
    # The repaired node came back as a spare, the used spare now works for the job.
    assert summary["nodes"]["by_state"] == {"healthy": 14, "spare": 2}
    assert summary["nodes"]["unhealthy"]["gpu-node-05"]["state"] == "spare"


def test_import_layers_hold() -> None:
    """collector → analyzer → healer one way; analyzer pure; only the adapter imports kubernetes."""
    out = subprocess.run([_bin("lint-imports")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout and "KEPT" in out.stdout


def test_the_node_agent_does_not_load_the_control_planes_libraries() -> None:
    """`kmend agent` runs on every GPU node: the web stack, the database and scikit-learn stay out of it."""
    code = ("import sys, kmend.cli, kmend.commands.agent; kmend.cli.build_parser(); "
            "print(sorted(m for m in ('sklearn', 'pandas', 'fastapi', 'uvicorn', 'sqlalchemy', 'kubernetes', 'torch')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
