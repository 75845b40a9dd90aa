"""POST /v1/ingest/fluentbit: records from Fluent Bit's http output (json_lines or json).

A body that is not JSON records is refused whole (422). Within a good body, a record whose
values no store can hold (node name, NUL, time) is left out and named in the answer while
the others are kept: Fluent Bit retries a whole flush on any error, so one bad record must
never turn the flush into an error.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from collector.fluentbit import parse_payload, record_to_signal
from collector.signal import Signal
from collector.validate import signal_problem
from kmend.api.deps import IngestAuth, KmendDep, SettingsDep
from kmend.api.signals import REJECTED, NodeQuery, read_body, server_timed

router = APIRouter(prefix="/v1/ingest", tags=["ingest"])


@router.post("/fluentbit", dependencies=[IngestAuth], responses={400: REJECTED, 413: REJECTED, 422: REJECTED})
async def ingest_fluentbit(request: Request, kmend: KmendDep, settings: SettingsDep, node: NodeQuery = None
                           ) -> dict[str, Any]:
    """Map Fluent Bit records to signals and ingest them; a retried POST is harmless."""
    body = await read_body(request, settings.max_batch_bytes)
    try:
        records = parse_payload(body, max_records=settings.max_records)
    except ValueError as exc:
        kmend.metrics.rejected.inc()
        raise HTTPException(422, f"batch rejected: {exc}") from exc
    now = kmend.clock()
    signals: list[Signal] = []
    problems: list[dict[str, Any]] = []
    skipped = 0
    for i, r in enumerate(records):
        s = record_to_signal(r, default_node=node, now=now)
        if s is None:
            skipped += 1
        elif (why := signal_problem(s)) is not None:
            problems.append({"record": i, "problem": why})
        else:
            signals.append(s)
    if problems:
        kmend.metrics.rejected_records.labels("fluentbit").inc(len(problems))
    # Store and analysis block: off the event loop, so other requests are not held up.
    outcome = await run_in_threadpool(kmend.ingest, server_timed(signals, kmend, settings))
    return {
        "accepted": outcome.accepted,
        "duplicates": outcome.duplicates,
        "skipped": skipped,
        "rejected": len(problems),
        "problems": problems[:20],
        "findings": len(outcome.findings),
    }
