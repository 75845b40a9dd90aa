"""Nodes: health state per node."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kmend.api.deps import KmendDep

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.get("")
def list_nodes(kmend: KmendDep) -> dict[str, Any]:
    """Every node with kmend's view of its health."""
    return {"nodes": kmend.node_health()}
