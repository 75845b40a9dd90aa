"""The FastAPI application: built from a ready Kmend core, no import-time state."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kmend.api import alerts, flight_recorder, fluentbit, health, incidents, nodes, signals
from kmend.service import Kmend
from kmend.settings import Settings


def create_app(kmend: Kmend, settings: Settings, *, run_healer: bool = True) -> FastAPI:
    """An app serving `kmend`; the healer loop runs while the app runs."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not kmend.ready:
            kmend.start()
        stop = threading.Event()
        worker = None
        if run_healer:
            worker = threading.Thread(target=kmend.run_healer, args=(stop,), name="kmend-healer", daemon=True)
            worker.start()
        try:
            yield
        finally:
            stop.set()
            kmend.wake()
            if worker:
                worker.join(timeout=10)

    app = FastAPI(title="kmend", version="0.1.0", lifespan=lifespan)
    app.state.kmend = kmend
    app.state.settings = settings
    for r in (signals.router, fluentbit.router, alerts.router, flight_recorder.router, incidents.router,
              nodes.router, health.router):
        app.include_router(r)
    return app
