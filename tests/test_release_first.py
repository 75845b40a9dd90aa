"""A release cut short by kill -9 after its plan was journaled but before it cancelled the node's other plans (here:
a drain whose eviction was in flight): the restarted `kmend serve --cluster kube` finishes the release before it
resumes any other plan, so the drain makes no further eviction, its step left running is closed, and the node ends
released."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from healer.policy import release_plan
from healer.records import PlanState
from kmend.store import Store
from kmend.store.store import RELEASE_ID
from tests.procs import Served
from tests.test_decided_plan_crash import _fault, _operator, _world
from tests.waiting import until


def test_release_plans_carry_the_id_the_loop_orders_by() -> None:
    assert release_plan("gpu-1", "alice", 0.0).id.startswith(RELEASE_ID)


@pytest.mark.slow
def test_an_unfinished_release_is_finished_before_the_nodes_drain_is_resumed(tmp_path: Path) -> None:
    with _world(tmp_path) as world:
        served = world.serve("first")
        again: list[Served] = []
        try:
            with _operator(served) as operator:
                _fault(served, "gpu-1")
                until("the drain's first eviction held on the server", world.held.is_set)
                [drain_plan] = operator.get("/v1/plans", params={"node": "gpu-1"}).json()["plans"]
                drain = next(s for s in drain_plan["steps"] if s["kind"] == "drain")
            served.proc.kill()  # SIGKILL with the drain's eviction in flight
            served.proc.wait(timeout=30)
            # What a release killed right after journaling its plan leaves: the plan, nothing cancelled or written.
            store = Store(f"sqlite:///{tmp_path / 'k.db'}")
            try:
                store.save_plan(replace(release_plan("gpu-1", "operator-token (o)", time.time()),
                                        state=PlanState.RUNNING))
            finally:
                store.close()
            world.let_go.set()
            evicted = len(world.evictions)

            again.append(world.serve("second"))
            with _operator(again[0]) as operator:
                def released() -> dict[str, Any] | None:
                    with world.api._lock:
                        node = world.api.nodes["gpu-1"]
                        if node["spec"].get("unschedulable") or not any(
                                e.get("reason") == "KmendReleased" for e in world.api.events):
                            return None
                    got: dict[str, Any] = operator.get(f"/v1/plans/{drain_plan['id']}").json()
                    return got if got["state"] == "cancelled" else None

                after = until("gpu-1 released and its drain plan cancelled by the restarted service", released)
                step = next(s for s in after["steps"] if s["id"] == drain["id"])
                # Never run again: closed as the crash left it, naming the restart and the release.
                assert step["state"] == "interrupted" and "released by" in step["result"], step
                assert not [s for s in after["steps"] if s["state"] in ("pending", "waiting", "running")], after
                _fault(again[0], "gpu-2")  # later rounds go on; the drain stays as it is
                until("gpu-2 cordoned", lambda: "gpu-2" in world.cordons)
            assert len(world.evictions) == evicted, world.evictions
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail()}\n" + "\n---\n".join(s.tail() for s in again)) from None
        finally:
            served.stop()
            for s in again:
                s.stop()
