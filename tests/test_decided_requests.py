"""A plan rejected, or cancelled by its node's release, while its GPU reset waits for the node agent: every step not
yet ended ends (the waiting one `cancelled`, naming who decided), the node's open requests of that plan are withdrawn
(the agent's poll no longer lists them), and an answer that comes later is kept on the request but starts nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from collector.node_requests import Answer, HttpNodeRequestClient, NodeRequest, NodeRequestRunner, RequestJournal
from tests.builders import kernel
from tests.test_runbook_api import AGENT, OP, Served, _serve

NODE = "gpu-node-09"
XID48 = ("[ 100.0] NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error "
         "(DBE) has been detected on GPU in the framebuffer at partition 5, subpartition 1")


class _Reset:
    """The agent's GPU reset handler, counting what it is asked to carry out."""

    kind = "reset_gpu"

    def __init__(self) -> None:
        self.ran: list[str] = []

    def run(self, request: NodeRequest, stop: threading.Event) -> Answer:
        self.ran.append(request.id)
        return Answer("done", "reset")

    def resume(self, request: NodeRequest) -> Answer:
        return Answer("done", "reset")


def _polled(s: Served) -> list[dict[str, str]]:
    """What the node's agent sees when it polls."""
    r = s.client.get(f"/v1/nodes/{NODE}/requests", headers=AGENT)
    assert r.status_code == 200, r.text
    return list(r.json()["requests"])


@pytest.mark.parametrize("decision", ["reject", "release"])
def test_a_decided_plan_ends_its_waiting_reset_and_the_agent_no_longer_sees_it(tmp_path: Path, decision: str) -> None:
    with _serve(tmp_path) as s:
        s.post_signals([kernel(NODE, XID48)])
        [reset] = s.wait(lambda: [r for r in _polled(s) if r["kind"] == "reset_gpu"])
        [plan] = s.plans(node=NODE)
        s.wait(lambda: any(st["state"] == "waiting" for st in s.client.get(
            f"/v1/plans/{plan['id']}", headers=OP).json()["steps"]))
        if decision == "reject":
            r = s.client.post(f"/v1/plans/{plan['id']}/reject", headers=OP)
            assert r.status_code == 200 and r.json()["state"] == "rejected", r.text
            decided, by = "rejected", "rejected by"
        else:
            r = s.client.post(f"/v1/nodes/{NODE}/release", headers=OP)
            assert r.status_code == 200 and plan["id"] in r.json()["cancelled_plans"], r.text
            decided, by = "cancelled", "released by"
        got = s.client.get(f"/v1/plans/{plan['id']}", headers=OP).json()
        assert got["state"] == decided, got
        steps = {st["id"]: st for st in got["steps"]}
        assert not [st for st in steps.values() if st["state"] in ("pending", "running", "waiting")], got["steps"]
        repair = steps[reset["id"]]
        assert repair["state"] == "cancelled" and by in repair["result"] and "alice" in repair["result"], repair
        # The agent no longer sees any request of the decided plan (the reset nor the GPU report).
        assert not [r for r in _polled(s) if r["id"].startswith(plan["id"] + "-")], _polled(s)
        # The node agent's own poll starts nothing.
        reset_handler, client = _Reset(), HttpNodeRequestClient(str(s.client.base_url), token="agent-token")
        try:
            agent = NodeRequestRunner(node=NODE, client=client, journal=RequestJournal(tmp_path / "requests.json"),
                                      handlers={"reset_gpu": reset_handler})
            agent.poll_once(threading.Event())
        finally:
            client.close()
        assert reset_handler.ran == []
        every = s.client.get(f"/v1/nodes/{NODE}/requests", params={"all": "true"}, headers=AGENT).json()
        assert {r["id"]: r["state"] for r in every["requests"]}[reset["id"]] == "withdrawn", every
        # An answer that comes anyway (the agent had already started) is kept on the request and starts nothing.
        r = s.client.post(f"/v1/nodes/{NODE}/requests/{reset['id']}", headers=AGENT,
                          json={"state": "done", "message": "nvidia-smi -r: GPU 0 reset"})
        assert r.status_code == 200 and r.json()["state"] == "withdrawn", r.text
        assert "GPU 0 reset" in r.json()["result"], r.text
        after = s.client.get(f"/v1/plans/{plan['id']}", headers=OP).json()
        assert after["state"] == decided and after["steps"] == got["steps"], after


def test_a_plan_cancelled_by_a_hand_uncordon_ends_its_steps_and_withdraws_the_agents_reset(tmp_path: Path) -> None:
    """An operator uncordons the node with kubectl while its GPU reset waits for the agent: the plan is cancelled,
    none of its steps is left pending or waiting, and the agent's poll no longer lists the reset."""
    with _serve(tmp_path) as s:
        s.post_signals([kernel(NODE, XID48)])
        [reset] = s.wait(lambda: [r for r in _polled(s) if r["kind"] == "reset_gpu"])
        [plan] = s.plans(node=NODE)
        s.world.cluster.uncordon(NODE)  # kubectl uncordon
        got = s.wait(lambda: (p := s.client.get(f"/v1/plans/{plan['id']}", headers=OP).json())["state"] == "cancelled"
                     and p)
        assert "uncordoned by hand" in got["reason"], got
        steps = {st["id"]: st for st in got["steps"]}
        assert not [st for st in steps.values() if st["state"] in ("pending", "running", "waiting")], got["steps"]
        repair = steps[reset["id"]]
        assert repair["state"] == "cancelled" and "uncordoned by hand" in repair["result"], repair
        assert not [r for r in _polled(s) if r["id"].startswith(plan["id"] + "-")], _polled(s)
        every = s.client.get(f"/v1/nodes/{NODE}/requests", params={"all": "true"}, headers=AGENT).json()
        assert {r["id"]: r["state"] for r in every["requests"]}[reset["id"]] == "withdrawn", every
        assert not s.world.cluster.get_node(NODE).unschedulable  # the operator's uncordon stands
