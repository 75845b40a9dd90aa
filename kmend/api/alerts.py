"""POST /v1/alerts/alertmanager: Alertmanager webhook notifications (version 4).

A notification that does not parse is refused whole (422; Alertmanager does not retry a
4xx). An alert whose node or labels no store can hold is left out and named in the answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from collector.alertmanager import WebhookIn, alert_to_signal
from collector.signal import Signal
from collector.validate import signal_problem
from kmend.api.deps import IngestAuth, KmendDep, SettingsDep
from kmend.api.signals import REJECTED, NodeQuery, server_timed

router = APIRouter(prefix="/v1/alerts", tags=["alerts"])


@router.post("/alertmanager", dependencies=[IngestAuth], responses={400: REJECTED, 413: REJECTED, 422: REJECTED})
def alertmanager_webhook(payload: WebhookIn, kmend: KmendDep, settings: SettingsDep, node: NodeQuery = None
                         ) -> dict[str, Any]:
    """Firing and resolved alerts become ``alert`` signals; a re-sent notification is harmless."""
    if payload.version != "4":
        raise HTTPException(422, f"unsupported webhook version {payload.version!r} (expected \"4\")")
    now = kmend.clock()
    signals: list[Signal] = []
    problems: list[dict[str, Any]] = []
    skipped = 0
    for i, a in enumerate(payload.alerts):
        s = alert_to_signal(a, default_node=node, now=now)
        if s is None:
            skipped += 1
        elif (why := signal_problem(s)) is not None:
            problems.append({"alert": i, "problem": why})
        else:
            signals.append(s)
    if problems:
        kmend.metrics.rejected_records.labels("alertmanager").inc(len(problems))
    outcome = kmend.ingest(server_timed(signals, kmend, settings))
    return {
        "accepted": outcome.accepted,
        "duplicates": outcome.duplicates,
        "skipped": skipped,
        "rejected": len(problems),
        "problems": problems[:20],
        "findings": len(outcome.findings),
    }
