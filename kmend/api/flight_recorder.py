"""POST /v1/flight-recorder: one rank's PyTorch Flight Recorder dump (raw pickle bytes)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request

from analyzer.detectors.flight_recorder import DumpError
from kmend.api.deps import IngestAuth, KmendDep, SettingsDep
from kmend.api.signals import check_node_param, read_body

router = APIRouter(prefix="/v1", tags=["ingest"])


@router.post("/flight-recorder", dependencies=[IngestAuth], status_code=202,
             responses={400: {"description": "not a readable Flight Recorder dump"}})
async def ingest_flight_recorder(
    request: Request, kmend: KmendDep, settings: SettingsDep,
    job: Annotated[str, Query(min_length=1, max_length=253)],
    rank: Annotated[int, Query(ge=0)],
    node: Annotated[str, Query(min_length=1, max_length=253)],
) -> Any:
    """Accept the dump a rank wrote on a collective timeout (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``).

    The body is parsed with an unpickler that refuses every class; dumps of one job
    are judged together once they stop arriving, and the finding names the ranks
    that never joined the stuck collective.
    """
    check_node_param(node)
    if "\x00" in job:
        raise HTTPException(422, "query parameter 'job': contains a NUL character")
    body = await read_body(request, settings.max_batch_bytes)
    try:
        kmend.ingest_flight_recorder(job, rank, node, body)
    except DumpError as exc:
        raise HTTPException(400, f"not a readable Flight Recorder dump: {exc}") from exc
    return {"accepted": True, "job": job, "rank": rank}
