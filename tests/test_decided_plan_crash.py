"""A step in flight when `kmend serve --cluster kube` is killed with SIGKILL, in a plan an operator had already decided
(rejected, or cancelled by the node's release): the restarted service closes the step as `interrupted`, with a result
naming the restart, journaled once, and never runs it again."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.wire import to_wire
from tests.builders import XID79, kernel
from tests.fake_apiserver import FakeApiServer
from tests.kube_worlds import llama_on_gpu_1
from tests.procs import Served, kube_serve_env, start_serve
from tests.waiting import until


@dataclass
class _World:
    """The fake API server with a job's pods on gpu-1; the drain's first eviction is held until `let_go`."""

    api: FakeApiServer
    tmp: Path
    held: threading.Event = field(default_factory=threading.Event)
    let_go: threading.Event = field(default_factory=threading.Event)
    evictions: list[str] = field(default_factory=list)
    cordons: list[str] = field(default_factory=list)

    def serve(self, name: str) -> Served:
        served = start_serve(self.tmp, name, {"KMEND_INGEST_TOKEN": "i", "KMEND_OPERATOR_TOKEN": "o",
                                              **kube_serve_env(self.tmp, self.api.url, "t"),
                                              "KMEND_DATABASE_URL": f"sqlite:///{self.tmp / 'k.db'}"})
        served.wait_ready()
        return served

    def journaled(self, step_id: str) -> tuple[str, str, float]:
        """The step's row in the journal: state, result and when it was last written."""
        with sqlite3.connect(self.tmp / "k.db") as db:
            row = db.execute("SELECT state, result, updated_at FROM plan_steps WHERE id = ?", (step_id,)).fetchone()
        return str(row[0]), str(row[1]), float(row[2])


@contextmanager
def _world(tmp_path: Path) -> Iterator[_World]:
    with FakeApiServer() as api:
        llama_on_gpu_1(api)  # three of the job's pods on gpu-1: three evictions for its drain
        world = _World(api, tmp_path)
        handle = api.handle

        def watched(method: str, path: str, body: Any, ctype: str,
                    query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
            if method == "POST" and path.endswith("/eviction"):
                world.evictions.append(path)
                if not world.held.is_set():  # the first eviction: held, then never applied
                    world.held.set()
                    world.let_go.wait(120)
                    return 503, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                                 "reason": "ServiceUnavailable", "message": "the request never reached storage"}
            if method == "PATCH" and path.startswith("/api/v1/nodes/") and isinstance(body, dict) \
                    and (body.get("spec") or {}).get("unschedulable"):
                world.cordons.append(path.split("/")[4])
            return handle(method, path, body, ctype, query)

        api.handle = watched  # type: ignore[method-assign]
        try:
            yield world
        finally:
            world.let_go.set()


def _operator(served: Served) -> httpx.Client:
    return httpx.Client(base_url=served.url, headers={"authorization": "Bearer o"}, timeout=60)


def _fault(served: Served, node: str) -> None:
    with httpx.Client(base_url=served.url, headers={"authorization": "Bearer i"}, timeout=30) as agent:
        agent.post("/v1/signals", json={"signals": [to_wire(kernel(node, XID79))]}).raise_for_status()


@pytest.mark.slow
@pytest.mark.parametrize("decision", ["reject", "release"])
def test_a_step_in_flight_at_kill_9_in_a_decided_plan_is_closed_on_restart_once(tmp_path: Path,
                                                                                decision: str) -> None:
    with _world(tmp_path) as world:
        served = world.serve("first")
        again: list[Served] = []
        try:
            with _operator(served) as operator:
                _fault(served, "gpu-1")
                until("the drain's first eviction held on the server", world.held.is_set)
                plan = operator.get("/v1/plans", params={"node": "gpu-1"}).json()["plans"][0]
                drain = next(s for s in plan["steps"] if s["kind"] == "drain")
                if decision == "reject":
                    answer = operator.post(f"/v1/plans/{plan['id']}/reject")
                    assert answer.status_code == 200 and answer.json()["state"] == "rejected", answer.text
                    decided = "rejected"
                else:
                    answer = operator.post("/v1/nodes/gpu-1/release")
                    assert answer.status_code == 200 and plan["id"] in answer.json()["cancelled_plans"], answer.text
                    decided = "cancelled"
            assert world.journaled(drain["id"])[0] == "running"  # the eviction is still in flight
            served.proc.kill()  # SIGKILL: the drain's result is never journaled
            served.proc.wait(timeout=30)
            world.let_go.set()
            evicted = len(world.evictions)

            again.append(world.serve("second"))
            with _operator(again[0]) as operator:
                def closed() -> dict[str, Any] | None:
                    got = operator.get(f"/v1/plans/{plan['id']}").json()
                    step = next(s for s in got["steps"] if s["id"] == drain["id"])
                    return got if step["state"] != "running" else None

                after = until("the drain step closed by the restarted service", closed)
            step = next(s for s in after["steps"] if s["id"] == drain["id"])
            assert after["state"] == decided, after
            assert step["state"] == "interrupted", step
            assert "restart" in step["result"] and decided in step["result"], step
            first = world.journaled(drain["id"])
            # The restarted loop ran rounds after closing it (another node's fault is cordoned): nothing ran again,
            # and the step was journaled once (nor does a second restart close it: tests/test_interrupted_steps.py).
            _fault(again[0], "gpu-2")
            until("gpu-2 cordoned", lambda: "gpu-2" in world.cordons)
            assert world.journaled(drain["id"]) == first
            assert len(world.evictions) == evicted, world.evictions
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail()}\n" + "\n---\n".join(s.tail() for s in again)) from None
        finally:
            served.stop()
            for s in again:
                s.stop()
