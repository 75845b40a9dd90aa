"""POST /v1/ingest/fluentbit: records from Fluent Bit's http output (json_lines or json)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request

from collector.fluentbit import parse_payload, record_to_signal
from kmend.api.deps import IngestAuth, KmendDep, SettingsDep
from kmend.api.signals import read_body

router = APIRouter(prefix="/v1/ingest", tags=["ingest"])


@router.post("/fluentbit", dependencies=[IngestAuth],
             responses={422: {"description": "body is not JSON lines or a JSON array of objects"}})
async def ingest_fluentbit(request: Request, kmend: KmendDep, settings: SettingsDep,
                           node: str | None = Query(None, description="node for records that name none")
                           ) -> dict[str, Any]:
    """Map Fluent Bit records to signals and ingest them; a retried POST is harmless."""
    body = await read_body(request, settings.max_batch_bytes)
    try:
        records = parse_payload(body, max_records=settings.max_records)
    except ValueError as exc:
        kmend.metrics.rejected.inc()
        raise HTTPException(422, f"batch rejected: {exc}") from exc
    now = kmend.clock()
    signals = [s for r in records if (s := record_to_signal(r, default_node=node, now=now)) is not None]
    outcome = kmend.ingest(signals)
    return {
        "accepted": outcome.accepted,
        "duplicates": outcome.duplicates,
        "skipped": len(records) - len(signals),
        "findings": len(outcome.findings),
    }
