"""Nodes: health state per node; operator quarantine and release; repair requests agents poll and answer."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from healer.cluster import NotFoundError
from healer.steps.base import RepairRequest
from kmend.api.deps import AgentOrOperatorAuth, KmendDep, OperatorAuth, OperatorDep, ReadAuth
from kmend.serialize import plan_to_dict

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


class QuarantineBody(BaseModel):
    """Why an operator quarantines a node."""

    reason: str = Field("quarantined by an operator", max_length=500)


class Answer(BaseModel):
    """What the node agent or the platform reports about a request."""

    state: Literal["done", "failed"]
    message: str = Field("", max_length=65536)
    """What happened; a GPU's ``nvidia-smi -q`` report (about 15,000 characters) for a ``gpu_query``."""


def _request(r: RepairRequest) -> dict[str, Any]:
    return {"id": r.id, "node": r.node, "kind": r.kind, "params": dict(r.params), "state": r.state,
            "result": r.result}


@router.get("", dependencies=[ReadAuth])
def list_nodes(kmend: KmendDep) -> dict[str, Any]:
    """Every node with kmend's view of its health."""
    return {"nodes": kmend.node_health()}


@router.post("/{name}/quarantine", dependencies=[OperatorAuth])
def quarantine(name: str, kmend: KmendDep, who: OperatorDep, body: QuarantineBody | None = None) -> dict[str, Any]:
    """Cordon, taint and mark the node, journaled as a plan (the breaker does not stop an operator)."""
    try:
        plan = kmend.healing.quarantine(name, who, (body or QuarantineBody()).reason)
    except NotFoundError:
        raise HTTPException(404, f"no node {name!r}") from None
    return plan_to_dict(plan)


@router.post("/{name}/release", dependencies=[OperatorAuth])
def release(name: str, kmend: KmendDep, who: OperatorDep) -> dict[str, Any]:
    """Put the node back in service; kmend's unfinished plans for it are cancelled."""
    try:
        cancelled = kmend.healing.release(name, who)
    except NotFoundError:
        raise HTTPException(404, f"no node {name!r}") from None
    return {"node": name, "released_by": who, "cancelled_plans": cancelled}


@router.get("/{name}/requests", dependencies=[AgentOrOperatorAuth])
def list_requests(name: str, kmend: KmendDep, all: bool = False, capabilities: str | None = None) -> dict[str, Any]:
    """Repair requests for the node: the node agent polls this (``capabilities``: the request kinds it
    carries out, comma-separated) and resets a GPU once it is idle, or searches a pod's checkpoints."""
    caps = None if capabilities is None else frozenset(c for c in capabilities.split(",") if c)
    reqs = kmend.healing.requests(name, pending_only=not all, capabilities=caps)
    return {"node": name, "requests": [_request(r) for r in reqs]}


@router.post("/{name}/requests/{request_id}", dependencies=[AgentOrOperatorAuth])
def answer_request(name: str, request_id: str, body: Answer, kmend: KmendDep) -> dict[str, Any]:
    """The agent (GPU reset) or the platform (reboot, replacement) reports the request done or failed."""
    try:
        answered = kmend.healing.answer(name, request_id, body.state, body.message)
    except KeyError:
        raise HTTPException(404, f"no request {request_id!r} for node {name!r}") from None
    kmend.wake()
    return _request(answered)
