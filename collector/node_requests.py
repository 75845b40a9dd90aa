"""Node requests the service asks of this node's agent: poll, carry out once, answer.

The service queues requests per node (``GET /v1/nodes/{node}/requests``): a GPU reset,
a search for a job's checkpoint on a volume only this node mounts. The agent polls,
runs each request it has a handler for in its own thread (a reset waits for the GPU to
go idle; the agent's log loop must not wait with it), and answers
``POST /v1/nodes/{node}/requests/{id}``.

Exactly once across agent restarts: before a handler starts, the request id is written
to a journal file (fsync, rename). A request found journaled as started but not answered
is never started again; the handler's ``resume`` only reads the outcome back (for a GPU
reset: is the GPU healthy now?). An answer that could not be delivered stays in the
journal and is re-sent on the next poll, so a service restart loses no answer either.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from collector.checkpoint import write_json_atomically

log = logging.getLogger(__name__)

MAX_MESSAGE = 65536
"""Characters of an answer sent (the service takes this many: a GPU's whole ``nvidia-smi -q`` report fits)."""


@dataclass(frozen=True, slots=True)
class NodeRequest:
    """One request as the service sends it."""

    id: str
    """Stable id (the plan step's id)."""
    kind: str
    """What to do: ``reset_gpu``, ``find_checkpoint``, …"""
    params: Mapping[str, str]
    """The kind's parameters (GPU index or PCI id, checkpoint path, pod UID, …)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """How a request ended."""

    state: str
    """``done`` or ``failed``."""
    message: str
    """What happened, for people (and, for some kinds, JSON the service reads)."""


class RequestHandler(Protocol):
    """Carries out one kind of request on this node.

    Guarantees: ``run`` never raises (it answers ``failed`` with the reason instead) and may
    block for as long as the request needs; ``resume`` never repeats a side effect, it only
    finds out how an interrupted ``run`` ended.
    """

    kind: str
    """The request kind handled."""

    def run(self, request: NodeRequest, stop: threading.Event) -> Answer:
        """Carry the request out."""
        ...

    def resume(self, request: NodeRequest) -> Answer:
        """The request was started before the agent restarted: report its outcome without redoing it."""
        ...


class Halt(threading.Event):
    """What a running request's handler waits on: set when the service withdraws the request (its next poll no longer
    lists it: the operator rejected the plan, released the node, or kmend cancelled the plan) or when the agent stops.
    ``why`` says which. A handler checks it before each side effect it can still leave out; a reset already under way
    (``nvidia-smi --gpu-reset``: seconds) runs to its end."""

    SLICE_S = 0.25
    """How often a wait looks at the agent's own stop."""

    def __init__(self, agent_stop: threading.Event) -> None:
        super().__init__()
        self.agent_stop = agent_stop
        self.reason = ""

    @property
    def why(self) -> str:
        """Why the handler should stop ("" while it should go on)."""
        if super().is_set():
            return self.reason
        return "the agent stopped" if self.agent_stop.is_set() else ""

    def withdraw(self, why: str) -> None:
        """The service no longer asks for the request."""
        self.reason = why
        self.set()

    def is_set(self) -> bool:
        return super().is_set() or self.agent_stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = self.SLICE_S if deadline is None else min(self.SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)
        return True


class RequestJournal:
    """``{id: {"state": "started"|"answered", "answer": {...}}}`` in one JSON file, replaced atomically."""

    def __init__(self, path: Path, *, keep: int = 500) -> None:
        self.path = path
        self.keep = keep
        self._lock = threading.Lock()
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raw = {}
        except ValueError:
            # Never torn by us; outside damage. Forgetting could repeat a reset, so refuse
            # everything the file may have held: the service times those requests out.
            path.replace(path.with_name(path.name + ".corrupt"))
            raw = {}
        self._data: dict[str, dict[str, Any]] = raw if isinstance(raw, dict) else {}

    def get(self, request_id: str) -> dict[str, Any] | None:
        """The entry for a request, if any."""
        with self._lock:
            entry = self._data.get(request_id)
            return dict(entry) if entry else None

    def started(self, request_id: str) -> None:
        """Record, durably, that a request's side effects may begin."""
        self._put(request_id, {"state": "started", "at": time.time()})

    def finished(self, request_id: str, answer: Answer) -> None:
        """Record the outcome (to be delivered)."""
        self._put(request_id, {"state": "finished", "answer": {"state": answer.state, "message": answer.message}})

    def delivered(self, request_id: str) -> None:
        """The service has the answer."""
        entry = self.get(request_id) or {}
        self._put(request_id, {**entry, "state": "delivered"})

    def undelivered(self) -> dict[str, Answer]:
        """Answers not yet accepted by the service."""
        with self._lock:
            return {rid: Answer(e["answer"]["state"], e["answer"]["message"])
                    for rid, e in self._data.items() if e.get("state") == "finished"}

    def _put(self, request_id: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self._data[request_id] = entry
            if len(self._data) > self.keep:
                done = [k for k, v in self._data.items() if v.get("state") == "delivered"]
                for k in done[: len(self._data) - self.keep]:
                    del self._data[k]
            write_json_atomically(self.path, self._data)


class NodeRequestClient(Protocol):
    """The service's node-request endpoints."""

    def pending(self, node: str, capabilities: list[str]) -> list[NodeRequest]:
        """Pending requests for the node; the call also tells the service what this agent can do."""
        ...

    def answer(self, node: str, request_id: str, answer: Answer) -> bool:
        """Deliver an answer; False when the service did not take it (try again later)."""
        ...


class HttpNodeRequestClient:
    """``GET``/``POST /v1/nodes/{node}/requests`` with the agent's bearer token."""

    def __init__(self, base_url: str, *, token: str | None, timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                    transport=transport)

    def pending(self, node: str, capabilities: list[str]) -> list[NodeRequest]:
        resp = self._client.get(f"/v1/nodes/{node}/requests", params={"capabilities": ",".join(capabilities)})
        resp.raise_for_status()
        out = []
        for r in resp.json().get("requests", []):
            params = r.get("params") or {}
            out.append(NodeRequest(str(r["id"]), str(r["kind"]), {str(k): str(v) for k, v in params.items()}))
        return out

    def answer(self, node: str, request_id: str, answer: Answer) -> bool:
        resp = self._client.post(f"/v1/nodes/{node}/requests/{request_id}",
                                 json={"state": answer.state, "message": answer.message[:MAX_MESSAGE]})
        if resp.status_code == 404:
            # The service forgot the request (it was cancelled): nothing will ever take this answer.
            log.warning("request %s is unknown to the service; its answer (%s) is dropped", request_id, answer.state)
            return True
        return resp.is_success

    def close(self) -> None:
        """Close connections."""
        self._client.close()


class NodeRequestRunner:
    """Polls for this node's requests and runs each once, in its own thread."""

    def __init__(self, *, node: str, client: NodeRequestClient, journal: RequestJournal,
                 handlers: Mapping[str, RequestHandler], interval: float = 10.0,
                 on_answer: Callable[[NodeRequest, Answer], None] | None = None) -> None:
        self.node = node
        self.client = client
        self.journal = journal
        self.handlers = dict(handlers)
        self.interval = interval
        self.on_answer = on_answer
        self._running: dict[str, threading.Thread] = {}
        self._halts: dict[str, Halt] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> list[str]:
        """What this agent can do (sent with every poll, so the service plans only what can run)."""
        return sorted(self.handlers)

    def poll_once(self, stop: threading.Event) -> None:
        """Deliver journaled answers, fetch requests, start what is new."""
        for rid, ans in self.journal.undelivered().items():
            if self.client.answer(self.node, rid, ans):
                self.journal.delivered(rid)
        listed = self.client.pending(self.node, self.capabilities)
        self._withdrawn({req.id for req in listed})
        for req in listed:
            handler = self.handlers.get(req.kind)
            if handler is None:
                continue  # another executor's kind (the platform reboots and replaces)
            with self._lock:
                if req.id in self._running and self._running[req.id].is_alive():
                    continue
                entry = self.journal.get(req.id)
                if entry is not None and entry.get("state") in ("finished", "delivered"):
                    continue  # answered; the service will stop listing it
                resumed = entry is not None and entry.get("state") == "started"
                halt = self._halts[req.id] = Halt(stop)
                t = threading.Thread(target=self._carry_out, args=(handler, req, resumed, halt),
                                     name=f"request-{req.kind}", daemon=True)
                self._running[req.id] = t
                t.start()

    def _withdrawn(self, listed: set[str]) -> None:
        """Halt the running requests the service no longer lists; forget the ended ones."""
        with self._lock:
            for rid, t in list(self._running.items()):
                if not t.is_alive():
                    del self._running[rid]
                    self._halts.pop(rid, None)
                elif rid not in listed and not (halt := self._halts[rid]).is_set():
                    log.warning("request %s was withdrawn by the service while it ran: stopping it where it can stop",
                                rid)
                    halt.withdraw("the service withdrew the request (its plan was decided or cancelled)")

    def _carry_out(self, handler: RequestHandler, req: NodeRequest, resumed: bool, stop: threading.Event) -> None:
        try:
            if resumed:
                log.info("request %s (%s) was started before a restart: reading its outcome", req.id, req.kind)
                ans = handler.resume(req)
            else:
                self.journal.started(req.id)
                log.info("carrying out request %s: %s %s", req.id, req.kind, dict(req.params))
                ans = handler.run(req, stop)
        except Exception as exc:  # a handler bug must answer, not leave the plan waiting
            log.exception("request %s (%s) failed", req.id, req.kind)
            ans = Answer("failed", f"{type(exc).__name__}: {exc}")
        self.journal.finished(req.id, ans)
        log.info("request %s (%s) %s: %s", req.id, req.kind, ans.state, ans.message[:300])
        if self.on_answer is not None:
            self.on_answer(req, ans)
        try:
            if self.client.answer(self.node, req.id, ans):
                self.journal.delivered(req.id)
        except httpx.HTTPError as exc:
            log.warning("answer to request %s not delivered (%s); it is re-sent on the next poll", req.id, exc)

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set; a service that is away is retried on the next round."""
        while not stop.is_set():
            try:
                self.poll_once(stop)
            except httpx.HTTPError as exc:
                log.info("node requests: service unreachable (%s); retrying in %.0f s", exc, self.interval)
            except Exception:
                log.exception("node requests: poll failed")
            stop.wait(self.interval)

    def wait_idle(self, timeout: float) -> bool:
        """Wait for running requests to end (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        for t in list(self._running.values()):
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._running.values())
