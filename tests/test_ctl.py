"""The operator CLI against a served kmend: get/describe/approve/reject/quarantine/release/breaker through a
kubeconfig-like context file, tables for people, JSON/YAML for scripts, exit codes for refusals and outages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.builders import XID79, kernel
from tests.conftest import free_port
from tests.test_runbook_api import _serve


def _ctl(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KMEND_CONFIG": str(tmp / "kmend-config.yaml")}
    env.pop("KMEND_SERVER", None)
    env.pop("KMEND_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "kmend.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


def _context_file(tmp: Path, server: str) -> None:
    (tmp / "op.token").write_text("op-token\n")
    (tmp / "kmend-config.yaml").write_text(yaml.safe_dump({
        "current-context": "lab",
        "contexts": [{"name": "lab", "server": server, "token-file": str(tmp / "op.token"), "operator": "alice"},
                     {"name": "reader", "server": server, "token": "agent-token"}]}))


@pytest.mark.slow
def test_operator_lists_describes_and_approves_a_plan(tmp_path: Path) -> None:
    with _serve(tmp_path, require_approval=True) as s:
        _context_file(tmp_path, str(s.client.base_url))
        s.post_signals([kernel("gpu-node-03", XID79)])
        [plan] = s.wait(lambda: s.plans(state="awaiting_approval"))

        out = _ctl(tmp_path, "get", "incidents")
        assert out.returncode == 0, out.stderr
        header, row = out.stdout.splitlines()[:2]
        assert header.split()[:4] == ["ID", "STATE", "CLASS", "HARDWARE"]
        assert "gpu_lost" in row and "replace_node" in row and "gpu-node-03 pci=0000:3b:00" in row

        got = json.loads(_ctl(tmp_path, "get", "plans", "-o", "json").stdout)
        assert [p["id"] for p in got["plans"]] == [plan["id"]]
        assert yaml.safe_load(_ctl(tmp_path, "get", "plans", "-o", "yaml").stdout)["plans"][0]["mode"] == "approval"

        inc_id = plan["incident_id"]
        desc = _ctl(tmp_path, "describe", "incident", inc_id).stdout
        assert f"Incident:     {inc_id}" in desc and "GPU has fallen off the bus" in desc and "xid-79" in desc

        approved = _ctl(tmp_path, "approve", plan["id"])
        assert approved.returncode == 0 and "approved" in approved.stdout, approved.stderr
        assert s.world.cluster.get_node("gpu-node-03").unschedulable
        audit = s.client.get("/v1/audit", headers={"authorization": "Bearer op-token"}).json()
        assert any("(alice)" in a.get("actor", "") for a in audit["entries"])

        q = _ctl(tmp_path, "quarantine", "gpu-node-11")
        assert q.returncode == 0 and s.world.cluster.get_node("gpu-node-11").unschedulable, q.stderr
        nodes = _ctl(tmp_path, "get", "nodes", "-o", "wide").stdout
        assert any(ln.startswith("gpu-node-11") and "quarantined" in ln and "kmend.io/fault" in ln
                   for ln in nodes.splitlines())
        r = _ctl(tmp_path, "release", "gpu-node-11")
        assert r.returncode == 0 and not s.world.cluster.get_node("gpu-node-11").unschedulable, r.stderr
        assert _ctl(tmp_path, "breaker").stdout.startswith("breaker closed")
        assert "spares" not in _ctl(tmp_path, "get", "spares").stderr

        # A token without the operator role is refused, with the service's reason and exit code 1.
        refused = _ctl(tmp_path, "--log-level", "error", "reject", plan["id"], "--context", "reader")
        assert refused.returncode == 1 and "403" in refused.stderr and "needs operator" in refused.stderr


def test_unreachable_service_and_unknown_context_have_their_own_exit_codes(tmp_path: Path) -> None:
    _context_file(tmp_path, f"http://127.0.0.1:{free_port()}")
    down = _ctl(tmp_path, "get", "incidents")
    assert down.returncode == 3 and "cannot reach kmend" in down.stderr
    bad = _ctl(tmp_path, "get", "incidents", "--context", "nope")
    assert bad.returncode == 2 and "context 'nope' not found" in bad.stderr and "Traceback" not in bad.stderr
