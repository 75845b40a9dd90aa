"""Incidents: list and detail."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query

from analyzer.records import IncidentState
from kmend.api.deps import KmendDep, ReadAuth

router = APIRouter(prefix="/v1/incidents", tags=["incidents"], dependencies=[ReadAuth])


@router.get("")
def list_incidents(kmend: KmendDep, state: IncidentState | None = None, node: str | None = None,
                   limit: int = Query(500, ge=1, le=5000)) -> dict[str, Any]:
    """Incident summaries, newest first."""
    items = kmend.store.list_incidents(state=state.value if state else None, node=node, limit=limit)
    return {"incidents": items}


@router.get("/{incident_id}")
def get_incident(incident_id: str, kmend: KmendDep) -> dict[str, Any]:
    """One incident with its findings and plans."""
    found = kmend.store.get_incident(incident_id)
    if found is None:
        raise HTTPException(404, f"no incident {incident_id!r}")
    return found
