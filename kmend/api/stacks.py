"""POST /v1/stacks: one training process's Python stack (``py-spy dump`` text), captured on a suspected hang."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from starlette.concurrency import run_in_threadpool

from analyzer.detectors.stacks import MAX_STACK_CHARS
from kmend.api.deps import IngestAuth, KmendDep
from kmend.api.signals import read_body

router = APIRouter(prefix="/v1", tags=["ingest"])

MAX_STACK_BODY = 256 * 1024
"""A dump of a process with many threads is a few tens of KB; larger bodies are refused."""


@router.post("/stacks", dependencies=[IngestAuth], status_code=202,
             responses={400: {"description": "body is not UTF-8 text"}, 413: {"description": "body too large"}})
async def ingest_stack(
    request: Request, kmend: KmendDep,
    job: Annotated[str, Query(min_length=1, max_length=253)],
    rank: Annotated[int, Query(ge=0)],
    node: Annotated[str, Query(min_length=1, max_length=253)],
    pid: Annotated[int, Query(ge=1)],
    state: Annotated[str, Query(pattern=r"^[A-Za-z]?$",
                                description="the process's state letter from /proc/<pid>/stat (T: stopped)")] = "",
    cpu_s: Annotated[float | None, Query(ge=0, le=1e12, allow_inf_nan=False,
                                         description="CPU time (user + system seconds) the process had used when its "
                                                     "stack was taken")] = None,
) -> Any:
    """Accept the stack the node agent captured; a job's stacks are judged together once they stop arriving.

    The finding names the rank whose main thread is outside the collective the
    others wait in (or the rank whose process is stopped), and carries the stacks, so the
    incident shows where it is stuck.
    """
    body = await read_body(request, MAX_STACK_BODY)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"body: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not text.strip():
        raise HTTPException(400, "body: empty stack dump")
    await run_in_threadpool(kmend.ingest_stack, job, rank, node, pid, text[:MAX_STACK_CHARS], state,
                            cpu_s)  # takes the lock
    return {"accepted": True, "job": job, "rank": rank}
