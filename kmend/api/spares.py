"""The hot-spare pool."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from kmend.api.deps import KmendDep, OperatorAuth

router = APIRouter(prefix="/v1/spares", tags=["runbook"], dependencies=[OperatorAuth])


@router.get("")
def list_spares(kmend: KmendDep) -> dict[str, Any]:
    """Every spare with its state and health; counts by state."""
    spares = kmend.healing.spares()
    keys = kmend.healing.policy.topology_keys
    counts = {s: sum(1 for x in spares if x.state == s) for s in ("available", "in-use", "unhealthy")}
    return {"size": len(spares), **counts, "topology_keys": list(keys),
            "spares": [{"name": x.name, "state": x.state, "healthy": x.healthy, "assigned_to": x.assigned_to,
                        "topology": dict(zip(keys, x.domains, strict=True))} for x in spares]}
