"""The audit log of runbook API calls."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from kmend.api.deps import KmendDep, OperatorAuth

router = APIRouter(prefix="/v1/audit", tags=["runbook"], dependencies=[OperatorAuth])

AUDITED_PREFIXES = ("/v1/plans", "/v1/breaker", "/v1/spares", "/v1/audit")
"""Every call under these paths is audited (and the node runbook routes, see ``audited``)."""


def audited(path: str) -> bool:
    """Whether a request path is a runbook call."""
    if path.startswith(AUDITED_PREFIXES):
        return True
    parts = path.strip("/").split("/")
    return len(parts) >= 4 and parts[:2] == ["v1", "nodes"] and parts[3] in ("quarantine", "release", "requests")


@router.get("")
def list_audit(kmend: KmendDep, limit: int = Query(200, ge=1, le=5000)) -> dict[str, Any]:
    """Latest runbook calls, newest first: who, what, answer."""
    return {"entries": kmend.store.ledger.audit_entries(limit)}
