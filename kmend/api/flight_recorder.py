"""POST /v1/flight-recorder: one rank's PyTorch Flight Recorder dump (raw pickle bytes)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.concurrency import run_in_threadpool

from analyzer.detectors.flight_recorder import DumpError
from collector.validate import MAX_NODE_NAME, NODE_NAME_PATTERN
from kmend.api.deps import IngestAuth, KmendDep, SettingsDep
from kmend.api.signals import REJECTED, read_body

router = APIRouter(prefix="/v1", tags=["ingest"])


@router.post("/flight-recorder", dependencies=[IngestAuth], status_code=202,
             responses={400: REJECTED, 413: REJECTED, 422: REJECTED})
async def ingest_flight_recorder(
    request: Request, kmend: KmendDep, settings: SettingsDep,
    job: Annotated[str, Query(min_length=1, max_length=253, pattern=r"^[^\x00]+$")],
    rank: Annotated[int, Query(ge=0, lt=2**31)],
    node: Annotated[str, Query(min_length=1, max_length=MAX_NODE_NAME, pattern=NODE_NAME_PATTERN)],
) -> Any:
    """Accept the dump a rank wrote on a collective timeout (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``).

    The body is parsed with an unpickler that refuses every class; dumps of one job
    are judged together once they stop arriving, and the finding names the ranks
    that never joined the stuck collective.
    """
    body = await read_body(request, settings.max_batch_bytes)
    try:
        await run_in_threadpool(kmend.ingest_flight_recorder, job, rank, node, body)  # parsing + lock: off the loop
    except DumpError as exc:
        raise HTTPException(400, f"not a readable Flight Recorder dump: {exc}") from exc
    return {"accepted": True, "job": job, "rank": rank}
