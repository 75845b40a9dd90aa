"""Runbook calls while a plan's drain goes on in the background under `kmend serve --cluster kube`: rejecting the
plan, releasing its node, and a quarantine of another node beside them answer within a second (each eviction
here takes 2 s on the server), with the decision journaled; the drain stops after the eviction in flight, and a
kill -9 right after the reject neither loses the decision nor resumes the drain."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.wire import to_wire
from tests.builders import XID79, container, kernel
from tests.fake_apiserver import FakeApiServer
from tests.kube_worlds import llama_on_gpu_1
from tests.procs import Served, kube_serve_env, start_serve
from tests.waiting import until

EVICT_S = 2.0
"""How long the server takes for each eviction of gpu-1's pods (three of them: a 6 s drain)."""
ANSWER_S = 1.0
"""How long a runbook call may take while the drain goes on (it used to wait for the whole drain)."""


@dataclass
class _World:
    """The fake API server with three of a job's pods on gpu-1, whose evictions take `EVICT_S` each."""

    api: FakeApiServer
    tmp: Path
    evicting: list[float]
    cordons: list[str]

    def serve(self, name: str) -> Served:
        served = start_serve(self.tmp, name, {"KMEND_INGEST_TOKEN": "i", "KMEND_OPERATOR_TOKEN": "o",
                                              **kube_serve_env(self.tmp, self.api.url, "t"),
                                              "KMEND_DATABASE_URL": f"sqlite:///{self.tmp / 'k.db'}"})
        served.wait_ready()
        return served


@contextmanager
def _world(tmp_path: Path) -> Iterator[_World]:
    with FakeApiServer() as api:
        llama_on_gpu_1(api)  # three of the job's pods on gpu-1: three evictions for its drain
        world = _World(api, tmp_path, [], [])
        handle = api.handle

        def timed(method: str, path: str, body: Any, ctype: str,
                  query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
            if method == "POST" and path.endswith("/eviction"):
                world.evicting.append(time.monotonic())
                time.sleep(EVICT_S)
            if method == "PATCH" and path.startswith("/api/v1/nodes/") and isinstance(body, dict) \
                    and (body.get("spec") or {}).get("unschedulable"):
                world.cordons.append(path.split("/")[4])
            return handle(method, path, body, ctype, query)

        api.handle = timed  # type: ignore[method-assign]
        yield world


def _operator(served: Served) -> httpx.Client:
    return httpx.Client(base_url=served.url, headers={"authorization": "Bearer o"}, timeout=60)


def _start_drain(served: Served, world: _World, operator: httpx.Client) -> dict[str, Any]:
    """gpu-1's Xid 79 under its job: its automatic plan, once the drain's first eviction is in flight."""
    agent = httpx.Client(base_url=served.url, headers={"authorization": "Bearer i"}, timeout=30)
    with agent:
        agent.post("/v1/signals", json={"signals": [
            to_wire(container("gpu-1", "step 100 loss 2.1", job="llama", rank=1, pod="llama-worker-1")),
            to_wire(kernel("gpu-1", XID79))]}).raise_for_status()
    until("the drain's first eviction", lambda: world.evicting)
    plan = operator.get("/v1/plans", params={"node": "gpu-1"}).json()["plans"][0]
    assert plan["state"] == "running", plan
    return plan


def _timed(call: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    answer = call()
    return answer, time.monotonic() - t0


def _drain_step(operator: httpx.Client, plan_id: str) -> dict[str, Any]:
    steps = operator.get(f"/v1/plans/{plan_id}").json()["steps"]
    return next(s for s in steps if s["kind"] == "drain")


def _quarantined(served: Served, world: _World, node: str) -> None:
    """A new fault on `node`, cordoned: the healer's rounds ran after whatever the test did before."""
    with httpx.Client(base_url=served.url, headers={"authorization": "Bearer i"}, timeout=30) as agent:
        agent.post("/v1/signals", json={"signals": [to_wire(kernel(node, XID79))]}).raise_for_status()
    until(f"{node} cordoned", lambda: node in world.cordons)


@pytest.mark.slow
def test_a_reject_during_the_drain_answers_at_once_and_survives_kill_9(tmp_path: Path) -> None:
    with _world(tmp_path) as world:
        served = world.serve("first")
        again: Served | None = None
        try:
            with _operator(served) as operator:
                plan = _start_drain(served, world, operator)
                rejected, took = _timed(lambda: operator.post(f"/v1/plans/{plan['id']}/reject"))
                in_flight = len(world.evicting)
                assert rejected.status_code == 200, rejected.text
                assert rejected.json()["state"] == "rejected" and "rejected by" in rejected.json()["reason"]
                assert took < ANSWER_S, (took, world.evicting)
                # The eviction in flight ends and is journaled as the drain's last result; no other starts.
                step = until("the drain step's result journaled",
                              lambda: (s := _drain_step(operator, plan["id"]))["state"] != "running" and s)
                assert "stopped" in step["result"], step
                # Stopped by the reject, the drain is not left waiting: it ends, naming who decided, as do the rest.
                assert step["state"] == "cancelled" and "rejected by" in step["result"], step
                decided = operator.get(f"/v1/plans/{plan['id']}").json()
                assert decided["state"] == "rejected"
                assert not [s for s in decided["steps"] if s["state"] in ("pending", "waiting", "running")], decided
            served.proc.send_signal(signal.SIGKILL)
            served.proc.wait(30)
            again = world.serve("again")
            # The restarted loop resumes every runnable plan in its first rounds: a rejected one is not among them.
            _quarantined(again, world, "gpu-2")
            with _operator(again) as operator:
                after = operator.get(f"/v1/plans/{plan['id']}").json()
            assert after["state"] == "rejected", after
            assert len(world.evicting) <= in_flight + 1 and len(world.evicting) < 3, world.evicting
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail()}\n{again.tail() if again else ''}") from None
        finally:
            served.stop()
            if again is not None:
                again.stop()


def test_a_release_during_the_drain_answers_at_once_and_stops_it(tmp_path: Path) -> None:
    with _world(tmp_path) as world:
        served = world.serve("serve")
        try:
            with _operator(served) as operator:
                plan = _start_drain(served, world, operator)
                released, took = _timed(lambda: operator.post("/v1/nodes/gpu-1/release"))
                in_flight = len(world.evicting)
                assert released.status_code == 200, released.text
                assert released.json()["cancelled_plans"] == [plan["id"]], released.json()
                assert took < ANSWER_S, (took, world.evicting)
                assert not world.api.nodes["gpu-1"]["spec"].get("unschedulable"), world.api.nodes["gpu-1"]["spec"]
                step = until("the drain step's result journaled",
                              lambda: (s := _drain_step(operator, plan["id"]))["state"] != "running" and s)
                assert "stopped" in step["result"], step
                assert step["state"] == "cancelled" and "released by" in step["result"], step
                _quarantined(served, world, "gpu-2")
                assert operator.get(f"/v1/plans/{plan['id']}").json()["state"] == "cancelled"
                assert len(world.evicting) <= in_flight + 1 and len(world.evicting) < 3, world.evicting
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail()}") from None
        finally:
            served.stop()


def test_calls_beside_a_reject_answer_while_the_drain_goes_on(tmp_path: Path) -> None:
    with _world(tmp_path) as world:
        served = world.serve("serve")
        try:
            answers: dict[str, tuple[int, float]] = {}

            def ask(name: str, call: Callable[[], httpx.Response]) -> None:
                got, took = _timed(call)
                answers[name] = (got.status_code, took)

            with _operator(served) as operator:
                plan = _start_drain(served, world, operator)
                # The reject, another node's quarantine and a read of the plan, all at once: none waits behind another.
                calls = {"reject": lambda: operator.post(f"/v1/plans/{plan['id']}/reject"),
                         "quarantine another node": lambda: operator.post("/v1/nodes/gpu-7/quarantine"),
                         "the plan": lambda: operator.get(f"/v1/plans/{plan['id']}")}
                threads = [threading.Thread(target=ask, args=item) for item in calls.items()]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
            assert all(code == 200 and took < ANSWER_S for code, took in answers.values()), answers
            assert "gpu-7" in world.cordons
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{served.tail()}") from None
        finally:
            served.stop()
