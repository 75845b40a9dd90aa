"""Runbook API on a served app: approvals, dry-run preview, operator quarantine/release, spares, breaker, audit,
node requests; operator tokens distinct from collector tokens; the breaker stops a correlated flood."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.wire import to_wire
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.world import JobSpec, SimWorld
from tests.builders import XID13, XID79, container, kernel

OP = {"authorization": "Bearer op-token", "x-kmend-operator": "alice"}
AGENT = {"authorization": "Bearer agent-token"}


class Served:
    def __init__(self, client: httpx.Client, kmend: Kmend, world: SimWorld, notifier: LogNotifier) -> None:
        self.client, self.kmend, self.world, self.notifier = client, kmend, world, notifier

    def post_signals(self, signals: list[Any]) -> None:
        r = self.client.post("/v1/signals", json={"signals": [to_wire(s) for s in signals]}, headers=AGENT)
        assert r.status_code == 200, r.text

    def wait(self, pred: Any, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if got := pred():
                return got
            time.sleep(0.05)
        raise AssertionError("condition not reached in time")

    def plans(self, **params: str) -> list[dict[str, Any]]:
        r = self.client.get("/v1/plans", params=params, headers=OP)
        assert r.status_code == 200, r.text
        return list(r.json()["plans"])


@contextlib.contextmanager
def _serve(tmp_path: Path, nodes: int = 16, **kw: Any) -> Iterator[Served]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", healer_interval_s=0.05,
                        symptom_settle_s=0.2, ingest_token="agent-token", operator_token="op-token", **kw)
    world = SimWorld(nodes=nodes, spares=2, job=JobSpec("llama", 4))
    notifier = LogNotifier()
    kmend = make_kmend(settings, cluster=world.cluster, workloads=world.workloads, notifier=notifier)
    with serve_in_thread(create_app(kmend, settings)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield Served(client, kmend, world, notifier)
    kmend.store.close()


def test_operator_token_is_distinct_from_the_collectors() -> None:
    with pytest.raises(ValueError, match="operator_token must differ"):
        Settings(ingest_token="same", operator_token="same")


def test_plan_waits_for_approval_and_runs_when_approved(tmp_path: Path) -> None:
    with _serve(tmp_path, require_approval=True) as s:
        s.post_signals([kernel("gpu-node-03", XID79)])
        [plan] = s.wait(lambda: s.plans(state="awaiting_approval"))
        assert not s.world.cluster.get_node("gpu-node-03").unschedulable
        assert s.client.post(f"/v1/plans/{plan['id']}/approve").status_code == 401
        assert s.client.post(f"/v1/plans/{plan['id']}/approve", headers=AGENT).status_code == 403  # wrong kind
        preview = s.client.post(f"/v1/plans/{plan['id']}/execute", params={"dry_run": "true"}, headers=OP).json()
        assert preview["dry_run"] and preview["would"][1]["would"] == "cordon gpu-node-03"
        assert not s.world.cluster.get_node("gpu-node-03").unschedulable and s.world.applied() == []
        r = s.client.post(f"/v1/plans/{plan['id']}/approve", headers=OP)
        assert r.status_code == 200 and r.json()["state"] == "running"
        assert s.world.cluster.get_node("gpu-node-03").unschedulable
        assert "approved by operator-token (alice)" in r.json()["reason"]
        assert s.client.post(f"/v1/plans/{plan['id']}/approve", headers=OP).status_code == 409
        assert any(n["event"] == "plan_needs_approval" for n in s.notifier.sent)
        audit = s.client.get("/v1/audit", headers=OP).json()["entries"]
        assert {(a["actor"], a["method"], a["status"]) for a in audit} >= {
            ("operator-token (alice)", "POST", 200), ("unauthenticated", "POST", 401),
            ("operator-token (alice)", "POST", 409)}


def test_rejected_plan_changes_nothing(tmp_path: Path) -> None:
    with _serve(tmp_path, require_approval=True) as s:
        s.post_signals([kernel("gpu-node-04", XID79)])
        [plan] = s.wait(lambda: s.plans(state="awaiting_approval"))
        r = s.client.post(f"/v1/plans/{plan['id']}/reject", headers=OP)
        assert r.status_code == 200 and r.json()["state"] == "rejected"
        time.sleep(0.3)
        assert s.world.applied() == []
        assert s.client.get(f"/v1/plans/{plan['id']}", headers=OP).json()["state"] == "rejected"
        assert s.client.get("/v1/plans/plan-nope", headers=OP).status_code == 404


def test_operator_quarantine_and_release(tmp_path: Path) -> None:
    with _serve(tmp_path) as s:
        r = s.client.post("/v1/nodes/gpu-node-06/quarantine", json={"reason": "flapping NIC"}, headers=OP)
        assert r.status_code == 200 and r.json()["state"] == "succeeded"
        node = s.world.cluster.get_node("gpu-node-06")
        assert node.unschedulable and node.annotations["kmend.io/quarantined-by"] == "operator-token (alice)"
        assert "flapping NIC" in node.annotations["kmend.io/quarantine-reason"]
        # node-problem-detector's convention: a problem condition is True while the problem lasts.
        assert {c.type: c.status for c in node.conditions if c.type != "Ready"} == {"KmendHealthy": "False",
                                                                             "KmendFault": "True"}
        assert s.client.post("/v1/nodes/nope/quarantine", headers=OP).status_code == 404
        r = s.client.post("/v1/nodes/gpu-node-06/release", headers=OP)
        assert r.status_code == 200
        node = s.world.cluster.get_node("gpu-node-06")
        assert not node.unschedulable and node.taint("kmend.io/fault") is None
        assert "kmend.io/quarantined" not in node.labels
        # Released first, then the acceptance check (run by the healer loop, so it may already have passed).
        conditions = {c.type: (c.status, c.reason) for c in node.conditions if c.type != "Ready"}
        assert conditions in ({"KmendHealthy": ("True", "ReleasedByOperator"),
                               "KmendFault": ("False", "ReleasedByOperator")},
                              {"KmendHealthy": ("True", "Validated"), "KmendFault": ("False", "Validated")})
        reasons = [e.reason for e in s.world.cluster.events if e.node == "gpu-node-06"]
        assert "KmendReleased" in reasons
        s.wait(lambda: s.world.cluster.get_node("gpu-node-06").taint("kmend.io/unvalidated") is None)
        node = s.world.cluster.get_node("gpu-node-06")
        assert {c.type: (c.status, c.reason) for c in node.conditions if c.type != "Ready"} == {
            "KmendHealthy": ("True", "Validated"), "KmendFault": ("False", "Validated")}
        reasons = [e.reason for e in s.world.cluster.events if e.node == "gpu-node-06"]
        assert reasons.index("KmendReleased") < reasons.index("KmendValidated")


def test_spares_are_listed_with_health_and_topology(tmp_path: Path) -> None:
    with _serve(tmp_path) as s:
        body = s.client.get("/v1/spares", headers=OP).json()
        assert body["size"] == 2 and body["available"] == 2
        assert [x["name"] for x in body["spares"]] == ["gpu-node-14", "gpu-node-15"]
        assert body["spares"][0]["topology"] == {"topology.kmend.io/leaf": "leaf-1",
                                                 "topology.kmend.io/spine": "spine-0"}
        assert 'kmend_spares{state="available"} 2.0' in s.client.get("/metrics", headers=OP).text


def test_gpu_reset_request_is_polled_and_answered_by_the_agent(tmp_path: Path) -> None:
    with _serve(tmp_path) as s:
        # An uncorrectable ECC error (Xid 48) recommends a GPU reset.
        s.post_signals([kernel("gpu-node-09", "[ 100.0] NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', "
                                              "name=<unknown>, An uncorrectable double bit error (DBE) has been "
                                              "detected on GPU in the framebuffer at partition 5, subpartition 1")])
        # Beside the repair, the node's queue holds the GPU's nvidia-smi -q request for the plan's evidence.
        reqs = s.wait(lambda: [r for r in s.client.get("/v1/nodes/gpu-node-09/requests", headers=AGENT).json()[
            "requests"] if r["kind"] != "gpu_query"])
        assert reqs[0]["kind"] in ("reset_gpu", "reboot", "replace")
        r = s.client.post(f"/v1/nodes/gpu-node-09/requests/{reqs[0]['id']}", headers=AGENT,
                          json={"state": "done", "message": "nvidia-smi -r: GPU 0 reset"})
        assert r.status_code == 200 and r.json()["state"] == "done"
        [plan] = s.plans(node="gpu-node-09")
        s.wait(lambda: s.client.get(f"/v1/plans/{plan['id']}", headers=OP).json()["state"] == "succeeded")
        node = s.world.cluster.get_node("gpu-node-09")
        assert node.labels["kmend.io/spare"] == "true" and not node.unschedulable  # validated: back as a spare


def test_application_fault_on_every_gpu_of_a_job_cordons_nothing(tmp_path: Path) -> None:
    with _serve(tmp_path) as s:
        nodes = [f"gpu-node-0{i}" for i in range(4)]
        s.post_signals([container(n, "iteration 3", job="llama") for n in nodes])
        s.post_signals([kernel(n, XID13, ts=1_700_000_000.0 + g) for n in nodes for g in range(8)])
        s.wait(lambda: any(n.get("event") == "notification" for n in s.notifier.sent))
        time.sleep(0.3)
        assert not any(n.unschedulable for n in s.world.cluster.list_nodes())
        assert [op for op, _ in s.world.applied()] == []


def test_correlated_flood_over_20_percent_stops_at_the_breaker(tmp_path: Path) -> None:
    with _serve(tmp_path, nodes=40) as s:
        bad = [f"gpu-node-{i:02d}" for i in range(0, 30, 3)]  # 10 of 40 nodes: 25%
        s.post_signals([kernel(n, XID79) for n in bad])
        s.wait(lambda: s.client.get("/v1/breaker", headers=OP).json()["tripped"])
        time.sleep(0.5)
        cordoned = [n.name for n in s.world.cluster.list_nodes() if n.unschedulable]
        assert len(cordoned) == 4  # 10% of 40 GPU nodes
        breaker = s.client.get("/v1/breaker", headers=OP).json()
        assert "5 of 40 GPU nodes" in breaker["reason"]
        blocked = s.wait(lambda: (b := s.plans(state="blocked")) and len(b) == 6 and b)
        assert any(n["event"] == "breaker_tripped" for n in s.notifier.sent)
        assert 'kmend_healer_breaker_tripped 1.0' in s.client.get("/metrics", headers=OP).text
        r = s.client.post(f"/v1/plans/{blocked[0]['id']}/execute", headers=OP)
        assert r.status_code == 409 and "reset it first" in r.json()["detail"]
        reset = s.client.post("/v1/breaker/reset", headers=OP).json()
        assert reset["tripped"] is False and reset["reset_by"] == "operator-token (alice)"
        time.sleep(0.3)
        assert len([n for n in s.world.cluster.list_nodes() if n.unschedulable]) == 4  # blocked plans wait
