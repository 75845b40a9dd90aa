"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kmend.api.deps import KmendDep, ReadAuth

router = APIRouter(tags=["ops"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(kmend: KmendDep, response: Response) -> dict[str, object]:
    """Ready when the store answers and state was rebuilt."""
    db = kmend.store.ping()
    ok = db and kmend.ready
    response.status_code = 200 if ok else 503
    return {"status": "ok" if ok else "unavailable", "database": db, "rules": len(kmend.rules)}


@router.get("/metrics", dependencies=[ReadAuth])
def metrics(kmend: KmendDep) -> Response:
    """Prometheus exposition."""
    kmend.node_health()  # refreshes the quarantined-nodes gauge
    return Response(generate_latest(kmend.metrics.registry), media_type=CONTENT_TYPE_LATEST)
