"""POST /v1/alerts/alertmanager: Alertmanager webhook notifications (version 4)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query

from collector.alertmanager import WebhookIn, alert_to_signal
from kmend.api.deps import IngestAuth, KmendDep

router = APIRouter(prefix="/v1/alerts", tags=["alerts"])


@router.post("/alertmanager", dependencies=[IngestAuth])
def alertmanager_webhook(payload: WebhookIn, kmend: KmendDep,
                         node: str | None = Query(None, description="node for alerts whose labels name none")
                         ) -> dict[str, Any]:
    """Firing and resolved alerts become ``alert`` signals; a re-sent notification is harmless."""
    if payload.version != "4":
        raise HTTPException(422, f"unsupported webhook version {payload.version!r} (expected \"4\")")
    now = kmend.clock()
    signals = [s for a in payload.alerts if (s := alert_to_signal(a, default_node=node, now=now)) is not None]
    outcome = kmend.ingest(signals)
    return {
        "accepted": outcome.accepted,
        "duplicates": outcome.duplicates,
        "skipped": len(payload.alerts) - len(signals),
        "findings": len(outcome.findings),
    }
