"""The FastAPI application: built from a ready Kmend core, no import-time state."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from healer.identity import TokenReviewer
from kmend.api import (
    alerts,
    audit,
    breaker,
    console,
    flight_recorder,
    fluentbit,
    health,
    incidents,
    nodes,
    plans,
    signals,
    spares,
    stacks,
)
from kmend.api.deps import Caller, ReadAuth, ReviewCache, describe
from kmend.api.limits import BodyLimit
from kmend.early import SchedulerLoop
from kmend.pruning import run_retention
from kmend.service import Kmend
from kmend.settings import Settings


def create_app(kmend: Kmend, settings: Settings, *, run_healer: bool = True,
               token_reviewer: TokenReviewer | None = None, scheduler_loop: SchedulerLoop | None = None) -> FastAPI:
    """An app serving `kmend`; the healer loop runs while the app runs.

    `token_reviewer` checks Kubernetes tokens when ``settings.token_review`` is on; ``scheduler_loop`` is the gang
    scheduler already running (``start_early``), stopped with the app.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not kmend.ready:
            kmend.start()
        stop = threading.Event()
        workers = []
        loop = scheduler_loop
        if run_healer:
            workers.append(threading.Thread(target=kmend.run_healer, args=(stop,), name="kmend-healer", daemon=True))
            # Off the healer's thread: a backlog's prune never sits between a fault and its cordon.
            workers.append(threading.Thread(target=run_retention, args=(kmend, stop), name="kmend-retention",
                                            daemon=True))
            if loop is None and kmend.scheduler is not None:
                loop = SchedulerLoop(kmend.scheduler, settings.scheduler_interval_s)
        for w in workers:
            w.start()
        if loop is not None:
            loop.start()
        try:
            yield
        finally:
            stop.set()
            kmend.wake()
            if loop is not None:
                loop.stop()  # and the Kubernetes port's watch threads with it
            elif kmend.scheduler is not None and callable(close := getattr(kmend.scheduler.port, "close", None)):
                close()
            for w in workers:
                w.join(timeout=10)

    # The schema and its UI are routes like any other: a reader or operator token (none in open mode).
    app = FastAPI(title="kmend", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)

    @app.get("/openapi.json", dependencies=[ReadAuth], include_in_schema=False)
    def openapi_schema() -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", dependencies=[ReadAuth], include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kmend")

    app.state.kmend = kmend
    app.state.settings = settings
    app.state.token_reviews = ReviewCache(token_reviewer) if token_reviewer is not None else None
    # Every body is bounded while it is read, before any route or JSON parser sees it.
    app.add_middleware(BodyLimit, max_bytes=settings.max_batch_bytes)
    for r in (signals.router, fluentbit.router, alerts.router, flight_recorder.router, incidents.router,
              nodes.router, health.router, plans.router, spares.router, breaker.router, audit.router, console.router,
              stacks.router):
        app.include_router(r)

    @app.middleware("http")
    async def audit_runbook_calls(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        """Every runbook call is recorded with who made it and what the answer was."""
        response = await call_next(request)
        path = request.url.path
        if audit.audited(path):
            # Who did it: the identity the token proved (or "unauthenticated"), with the name claimed.
            caller: Caller | None = getattr(request.state, "caller", None)
            actor = describe(caller, request.headers.get("x-kmend-operator"))
            detail = {"query": str(request.url.query)[:500]} if request.url.query else {}
            await run_in_threadpool(kmend.store.ledger.audit, actor, request.method, path, response.status_code,
                                    detail)
            kmend.metrics.api_calls.labels(path.split("/")[2] if path.count("/") >= 2 else path,
                                           str(response.status_code)).inc()
        return response

    return app
