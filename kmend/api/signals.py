"""POST /v1/signals: batches from collectors; a malformed batch is rejected whole."""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Sequence
from operator import attrgetter
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from collector.signal import Signal
from collector.validate import MAX_NODE_NAME, NODE_NAME_PATTERN, bound_time
from collector.wire import SignalBatch, to_record
from kmend.api.deps import IngestAuth, KmendDep, SettingsDep
from kmend.api.signal_decode import decode_fast, peek_origin
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.store import IngestOutcome

_TS = attrgetter("ts")

router = APIRouter(prefix="/v1", tags=["ingest"])


async def read_body(request: Request, limit: int) -> bytes:
    """Request body, gunzipped when sent with Content-Encoding: gzip, bounded in size.

    The raw body is already bounded by the BodyLimit middleware; gzip is inflated at most
    `limit` + 1 bytes, so a small bomb never expands in memory past the limit.
    """
    raw = await request.body()
    if request.headers.get("content-encoding", "").lower() == "gzip":
        try:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            raw = d.decompress(raw, limit + 1)
        except (zlib.error, gzip.BadGzipFile) as exc:
            raise HTTPException(400, f"body is not valid gzip: {exc}") from exc
        if len(raw) <= limit and not d.eof:
            raise HTTPException(400, "body is not valid gzip: truncated stream")
    if len(raw) > limit:
        raise HTTPException(413, f"batch larger than {limit} bytes (setting KMEND_MAX_BATCH_BYTES)")
    return raw


def server_timed(signals: Sequence[Signal], kmend: Kmend, settings: Settings) -> Sequence[Signal]:
    """Signals with times no further ahead of the server's clock than the skew window (sent time kept)."""
    now = kmend.clock()
    times = list(map(_TS, signals))
    # The common batch, checked in C: nothing ahead, nothing infinite or NaN (a NaN anywhere makes the sum NaN).
    if times and max(times) <= now + settings.max_clock_skew_s and math.isfinite(sum(times)):
        return signals
    return [bound_time(s, now, settings.max_clock_skew_s) for s in signals]


NodeQuery = Annotated[str | None, Query(description="node for records that name none (a Kubernetes node name)",
                                        min_length=1, max_length=MAX_NODE_NAME, pattern=NODE_NAME_PATTERN)]
"""The ``node`` query parameter: checked (and documented) as a Kubernetes node name."""


class Rejected(BaseModel):
    """A refused request: ``detail`` names the field (text), or is FastAPI's list of validation errors."""

    detail: str | list[dict[str, Any]]
    errors: list[dict[str, Any]] = []


REJECTED = {"model": Rejected, "description": "refused; the detail names the field"}


def validation_response(exc: ValidationError) -> JSONResponse:
    """422 naming every bad field as a dotted path (``signals.3.payload.text``)."""
    errors = [{"field": ".".join(str(p) for p in e["loc"]), "msg": e["msg"], "type": e["type"]}
              for e in exc.errors(include_url=False, include_input=False)]
    first = errors[0]["field"] if errors else ""
    return JSONResponse(status_code=422, content={
        "detail": f"batch rejected: invalid field {first!r}: {errors[0]['msg'] if errors else ''}",
        "errors": errors[:50],
    })


@router.post("/signals", dependencies=[IngestAuth],
             responses={400: REJECTED, 413: REJECTED, 422: REJECTED, 503: REJECTED})
async def ingest_signals(request: Request, kmend: KmendDep, settings: SettingsDep) -> Any:
    """Store and analyze a batch of signals. Repeated ids, and a numbered batch at or below its producer's last
    number, are accepted and ignored."""
    body = await read_body(request, settings.max_batch_bytes)
    # Decoding, analysis and the store all take CPU or block: off the event loop, so /healthz and
    # other requests go on while a batch is taken.
    return await run_in_threadpool(_take, body, kmend, settings)


def _take(body: bytes, kmend: Kmend, settings: Settings) -> Any:
    head = peek_origin(body)
    if head is not None:  # numbered: a replay is answered from its number before any signal is decoded
        replay = kmend.replayed(*head)
        if replay is not None:
            return _answer(replay)
    wait = kmend.grouped.turnstile.expected_wait()
    if settings.ingest_queue_s and wait > settings.ingest_queue_s:  # refused before any work: the agent resends
        kmend.metrics.busy.inc()
        return busy(wait, settings.ingest_queue_s)
    decoded: tuple[Sequence[Signal], tuple[str, int] | None] | None = decode_fast(body)
    if decoded is None:  # pydantic accepts what msgspec is stricter about, or names the bad field
        try:
            batch = SignalBatch.model_validate_json(body)
        except ValidationError as exc:
            kmend.metrics.rejected.inc()
            return validation_response(exc)
        origin = None if batch.producer is None or batch.seq is None else (batch.producer, batch.seq)
        decoded = ([to_record(s) for s in batch.signals], origin)
    signals = server_timed(decoded[0], kmend, settings)
    return _answer(kmend.ingest(signals, decoded[1]))


def busy(wait: float, budget: float) -> JSONResponse:
    """503 with Retry-After: the batch would wait `wait` s for its turn, past the budget; nothing of it was taken."""
    return JSONResponse(status_code=503, headers={"Retry-After": str(max(1, math.ceil(wait)))}, content={
        "detail": f"ingest is busy: this batch would wait {wait:.1f} s for its turn, more than {budget:g} s "
                  "(setting KMEND_INGEST_QUEUE_S); nothing was taken, send it again after Retry-After"})


def _answer(outcome: IngestOutcome) -> dict[str, Any]:
    return {
        "accepted": outcome.accepted,
        "duplicates": outcome.duplicates,
        "findings": len(outcome.findings),
        "incidents": sorted({i.id for i in outcome.incidents}),
    }
