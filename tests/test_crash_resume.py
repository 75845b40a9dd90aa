"""kill -9 of `kmend serve` at every change a plan makes, restarted each time: the plan completes and every
change to the (file-backed) simulated cluster is applied exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from collector.wire import to_wire
from healer.policy_file import default_policy_path
from sim.world import read_actions
from tests.builders import XID79, container, kernel
from tests.conftest import free_port
from tests.procs import wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BAD = "gpu-node-01"


def _hf_checkpoint(root: Path, step: int) -> None:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    with zipfile.ZipFile(d / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", b"weights")


class Service:
    """`kmend serve` as a child process on a temp SQLite file and a file-backed simulated cluster."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "cluster.json"
        policy = yaml.safe_load(default_policy_path().read_text())
        policy["defaults"]["drain_grace_s"] = 0
        (tmp / "policy.yaml").write_text(yaml.safe_dump(policy))
        _hf_checkpoint(tmp / "ck", 200)
        self.starts = 0

    def start(self, **crash: int) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        env = {**os.environ, "KMEND_DATABASE_URL": f"sqlite:///{self.tmp / 'kmend.db'}", "KMEND_CLUSTER": "sim",
               "KMEND_PORT": str(port), "KMEND_SIM_NODES": "16", "KMEND_SIM_SPARES": "2", "KMEND_SIM_JOB_NODES": "4",
               "KMEND_SIM_CHECKPOINT_PATH": str(self.tmp / "ck"), "KMEND_SIM_STATE_FILE": str(self.state),
               "KMEND_POLICY_FILE": str(self.tmp / "policy.yaml"), "KMEND_HEALER_INTERVAL_S": "0.05",
               "KMEND_SYMPTOM_SETTLE_S": "0"}
        env.pop("KMEND_SIM_CRASH_AFTER", None)
        env.pop("KMEND_SIM_CRASH_BEFORE", None)
        for k, v in crash.items():
            env[f"KMEND_SIM_CRASH_{k.upper()}"] = str(v)
        with open(self.tmp / f"serve-{self.starts}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=log)
        self.starts += 1
        url = f"http://127.0.0.1:{port}"
        if not crash:
            wait_ready(url, proc, log=self.tmp / f"serve-{self.starts - 1}.log")
        else:
            # A child set to crash may die before it is ready: the caller checks how it ended.
            with contextlib.suppress(AssertionError):
                wait_ready(url, proc, log=self.tmp / f"serve-{self.starts - 1}.log")
        return proc, url


def _plan(url: str) -> dict[str, Any] | None:
    try:
        plans = httpx.get(f"{url}/v1/plans", timeout=5).json()["plans"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return plans[0] if plans else None


def test_plan_completes_with_each_change_applied_once_across_kill_9(tmp_path: Path) -> None:
    svc = Service(tmp_path)
    proc, url = svc.start(after=1)
    signals = [container(BAD, "iteration 7", job="llama-70b-pretrain"), kernel(BAD, XID79)]
    with contextlib.suppress(httpx.HTTPError):  # stored before the healer acts; the kill may cut the reply
        httpx.post(f"{url}/v1/signals", json={"signals": [to_wire(s) for s in signals]}, timeout=10)
    kills = 0
    final: dict[str, Any] | None = None
    # Each restart costs a few seconds, more on a loaded machine: give up only when nothing moves for a minute.
    stalled_after, cap = 120.0, time.monotonic() + 840
    last_progress, last_seen = time.monotonic(), ""
    while time.monotonic() - last_progress < stalled_after and time.monotonic() < cap:
        if proc.poll() is not None:
            last_progress = time.monotonic()
            assert proc.returncode == -9, (tmp_path / f"serve-{svc.starts - 1}.log").read_text()[-2000:]
            kills += 1
            # Alternate: killed after a change landed (never journaled), or before it reached the "API server".
            proc, url = svc.start(**({"after": 1} if kills % 2 == 0 else {"before": 2}))
        plan = _plan(url)
        if plan is not None:
            seen = json.dumps([plan["state"], [s["state"] for s in plan["steps"]]])
            if seen != last_seen:
                last_seen, last_progress = seen, time.monotonic()
            for s in plan["steps"]:
                if s["kind"] == "repair" and s["state"] == "waiting":
                    req = s["outputs"].get("request")
                    if req:  # the platform replaced the node (the service may die under the call: asked again)
                        with contextlib.suppress(httpx.HTTPError):
                            httpx.post(f"{url}/v1/nodes/{BAD}/requests/{req}", json={"state": "done"}, timeout=5)
            if plan["state"] == "succeeded":
                final = plan
                break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert final is not None, f"plan did not finish after {kills} kills: {_plan(url)}"
    actions = read_actions(svc.state)
    changes = [(a["op"], a["target"]) for a in actions]
    assert kills >= 15, kills  # a crash at (or around) every change of the plan
    dupes = {k: n for k, n in Counter(changes).items() if n > 1}
    assert not dupes, dupes
    ops = [op.split(" ")[0] for op, _ in changes]
    for needed in ("cordon", "evict_pod", "delete_pod", "apply_config_map", "create_object", "uncordon"):
        assert needed in ops, needed
    assert ops.count("delete_pod") == 4  # every rank of the old run restarted, once
    state = json.loads(svc.state.read_text())
    node = next(n for n in state["cluster"]["nodes"] if n["name"] == BAD)
    assert not node["unschedulable"] and node["labels"]["kmend.io/spare"] == "true"
    assert [s["state"] for s in final["steps"]] == ["succeeded"] * len(final["steps"])
