"""Back-to-back faults under `kmend serve --cluster kube`: a second node's cordon does not wait for the first plan's
taint, label, condition and Event writes (here each takes half a second on the server), nor for the drain the loop
resumes for it or an operator's approval starts (evictions that take seconds each), while each node's own steps still
reach the server in the plan's order, each once, and both quarantines complete."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from collector.wire import to_wire
from tests.builders import XID79, container, kernel
from tests.conftest import free_port
from tests.fake_apiserver import FakeApiServer
from tests.kube_worlds import llama_on_gpu_1
from tests.procs import kube_serve_env, start_serve, wait_ready, write_kubeconfig
from tests.waiting import until

SLOW_S = 0.5
"""How long the server takes for each of the first node's writes after its cordon."""


def _write_of(method: str, path: str, body: Any) -> tuple[str, str] | None:
    """(node, what) for a write about a node: cordon, taint, label, condition or event."""
    if method == "PATCH" and path.startswith("/api/v1/nodes/"):
        parts = path.split("/")
        node = parts[4]
        if len(parts) > 5 and parts[5] == "status":
            return node, "condition"
        spec = (body or {}).get("spec") or {} if isinstance(body, dict) else {}
        if spec.get("unschedulable"):
            return node, "cordon"
        if "taints" in spec:
            return node, "taint"
        return node, "label"
    if method == "POST" and path.endswith("/events") and isinstance(body, dict) \
            and body.get("reason") == "KmendQuarantine":
        return (body.get("involvedObject") or {}).get("name", ""), "event"
    return None


def test_a_second_fault_is_cordoned_while_the_first_plans_later_writes_are_still_going(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        for i in range(40):  # enough nodes that the breaker lets two quarantines through
            api.add_node(f"gpu-{i}")
        seen: list[tuple[str, str]] = []
        lock = threading.Lock()
        handle = api.handle

        def timed(method: str, path: str, body: Any, ctype: str,
                  query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
            write = _write_of(method, path, body)
            if write is not None and write[0] == "gpu-1" and write[1] != "cordon":
                time.sleep(SLOW_S)
            code, answer = handle(method, path, body, ctype, query)
            if write is not None and code < 300:
                with lock:
                    seen.append(write)
            return code, answer

        api.handle = timed  # type: ignore[method-assign]
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        port = free_port()
        env = {**os.environ, "KMEND_CLUSTER": "kube", "KMEND_KUBECONFIG": str(kubeconfig), "KMEND_PORT": str(port),
               "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}", "KMEND_INGEST_TOKEN": "i",
               "KMEND_OPERATOR_TOKEN": "o", "KMEND_SYMPTOM_SETTLE_S": "0", "KMEND_EVENT_NAMESPACE": "kmend-system",
               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        log = tmp_path / "serve.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, stdout=fh,
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, log=log)
            with httpx.Client(base_url=url, headers={"authorization": "Bearer i"}, timeout=30) as agent:
                agent.post("/v1/signals", json={"signals": [to_wire(kernel("gpu-1", XID79))]}).raise_for_status()
                until("gpu-1 cordoned", lambda: ("gpu-1", "cordon") in seen)
                agent.post("/v1/signals", json={"signals": [to_wire(kernel("gpu-2", XID79))]}).raise_for_status()
                until("both quarantines complete", lambda: ("gpu-1", "event") in seen and ("gpu-2", "event") in seen)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nwrites: {seen}\n{log.read_text(errors='replace')[-3000:]}") from None
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        order = list(seen)
        # The second node was cordoned before the first plan's Event (its writes take 2.5 s in all).
        assert order.index(("gpu-2", "cordon")) < order.index(("gpu-1", "event")), order
        # Each node's writes in its plan's order: cordon, taint, label, condition(s), Event.
        for node in ("gpu-1", "gpu-2"):
            kinds = [what for n, what in order if n == node]
            firsts = sorted(dict.fromkeys(kinds), key=kinds.index)
            assert firsts == ["cordon", "taint", "label", "condition", "event"], (node, kinds)
            assert kinds.count("cordon") == 1 and kinds.count("event") == 1, (node, kinds)  # each step once


EVICT_S = 2.0
"""How long the server takes for each eviction of the first node's pods: its drain, resumed in a round, takes 6 s."""


@dataclass
class _SlowDrain:
    """`kmend serve` against the fake, three of a job's pods on gpu-1 whose evictions take `EVICT_S` each."""

    served: Any
    seen: list[tuple[str, str, float]]
    lock: threading.Lock

    def writes(self, node: str, what: str) -> list[float]:
        with self.lock:
            return [t for n, w, t in self.seen if n == node and w == what]


@contextmanager
def _slow_drain(tmp_path: Path) -> Iterator[_SlowDrain]:
    with FakeApiServer() as api:
        llama_on_gpu_1(api)  # three of the job's pods on gpu-1: three evictions for its drain
        seen: list[tuple[str, str, float]] = []
        lock = threading.Lock()
        handle = api.handle

        def timed(method: str, path: str, body: Any, ctype: str,
                  query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
            write = _write_of(method, path, body)
            if method == "POST" and path.endswith("/eviction"):
                write = ("gpu-1", "eviction")
                with lock:
                    seen.append(("gpu-1", "evicting", time.monotonic()))
                time.sleep(EVICT_S)
            code, answer = handle(method, path, body, ctype, query)
            if write is not None and code < 300:
                with lock:
                    seen.append((*write, time.monotonic()))
            return code, answer

        api.handle = timed  # type: ignore[method-assign]
        served = start_serve(tmp_path, "serve", {"KMEND_INGEST_TOKEN": "i", "KMEND_OPERATOR_TOKEN": "o",
                                                 **kube_serve_env(tmp_path, api.url, "t"),
                                                 "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"})
        try:
            served.wait_ready()
            yield _SlowDrain(served, seen, lock)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nwrites: {seen}\n{served.tail()}") from None
        finally:
            served.stop()


def test_a_second_fault_is_cordoned_while_the_first_plans_drain_is_still_evicting(tmp_path: Path) -> None:
    with _slow_drain(tmp_path) as d, \
            httpx.Client(base_url=d.served.url, headers={"authorization": "Bearer i"}, timeout=30) as agent:
        agent.post("/v1/signals", json={"signals": [
            to_wire(container("gpu-1", "step 100 loss 2.1", job="llama", rank=1, pod="llama-worker-1")),
            to_wire(kernel("gpu-1", XID79))]}).raise_for_status()
        until("the first node's drain evicting", lambda: d.writes("gpu-1", "evicting"))
        t0 = time.monotonic()
        agent.post("/v1/signals", json={"signals": [to_wire(kernel("gpu-2", XID79))]}).raise_for_status()
        cordoned = until("gpu-2 cordoned", lambda: d.writes("gpu-2", "cordon"))[0]
        until("the drain's three evictions", lambda: len(d.writes("gpu-1", "eviction")) == 3)
        until("gpu-2's quarantine Event", lambda: d.writes("gpu-2", "event"))
    # On the previous loop the cordon waited for the rest of the resumed drain: at least two more evictions.
    assert cordoned - t0 < EVICT_S, (cordoned - t0, d.seen)
    # The first node's steps stay in order, each once: its quarantine before any eviction, each pod evicted once.
    assert d.writes("gpu-1", "event")[0] < d.writes("gpu-1", "evicting")[0], d.seen
    assert len(d.writes("gpu-1", "evicting")) == 3 and len(d.writes("gpu-1", "cordon")) == 1, d.seen


IB_ERROR_12 = ("llama-worker-1:946:988 [0] transport/net_ib.cc:839 NCCL WARN NET/IB : Got completion with error 12, "
               "opcode 1, len 0, vendor err 129")
"""A fabric error on the first node: its replace-node plan waits for a person (network-approval)."""


def test_a_second_fault_is_cordoned_while_an_approved_plans_drain_is_still_evicting(tmp_path: Path) -> None:
    approved: list[httpx.Response] = []
    with _slow_drain(tmp_path) as d, \
            httpx.Client(base_url=d.served.url, headers={"authorization": "Bearer i"}, timeout=30) as agent, \
            httpx.Client(base_url=d.served.url, headers={"authorization": "Bearer o"}, timeout=60) as operator:
        agent.post("/v1/signals", json={"signals": [
            to_wire(container("gpu-1", IB_ERROR_12, job="llama", rank=1, pod="llama-worker-1"))]}
                   ).raise_for_status()
        plan = until("the plan awaiting approval", lambda: next(iter(operator.get(
            "/v1/plans", params={"state": "awaiting_approval"}).json()["plans"]), None))
        # The operator's approval, as `kmend approve` sends it, from a thread of its own.
        approving = threading.Thread(target=lambda: approved.append(
            operator.post(f"/v1/plans/{plan['id']}/approve")))
        approving.start()
        until("the approved plan's drain evicting", lambda: d.writes("gpu-1", "evicting"))
        t0 = time.monotonic()
        agent.post("/v1/signals", json={"signals": [to_wire(kernel("gpu-2", XID79))]}).raise_for_status()
        cordoned = until("gpu-2 cordoned", lambda: d.writes("gpu-2", "cordon"))[0]
        approving.join(timeout=60)
        until("the drain's three evictions", lambda: len(d.writes("gpu-1", "eviction")) == 3)
        until("gpu-2's quarantine Event", lambda: d.writes("gpu-2", "event"))
    # On the previous service the approval ran the drain inside the lock every healer round takes.
    assert cordoned - t0 < EVICT_S, (cordoned - t0, d.seen)
    assert approved and approved[0].status_code == 200 and approved[0].json()["state"] == "running", approved
    assert d.writes("gpu-1", "event")[0] < d.writes("gpu-1", "evicting")[0], d.seen
    assert len(d.writes("gpu-1", "evicting")) == 3 and len(d.writes("gpu-1", "cordon")) == 1, d.seen
