"""Helpers for the hostile-input tests: a served kmend on the simulated cluster, and waiting."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from collector.signal import Signal
from collector.wire import to_wire
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

T = TypeVar("T")


class Served:
    """A running service: its HTTP client and its core."""

    def __init__(self, client: httpx.Client, kmend: Kmend, url: str) -> None:
        self.client, self.kmend, self.url = client, kmend, url

    def post(self, signals: list[Signal], **kw: Any) -> httpx.Response:
        return self.client.post("/v1/signals", json={"signals": [to_wire(s) for s in signals]}, **kw)

    def incidents(self) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = self.client.get("/v1/incidents").json()["incidents"]
        return got


def wait_for(pred: Callable[[], T | None], timeout: float = 10.0) -> T:
    """The first truthy value of `pred`, polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


@contextlib.contextmanager
def serve(tmp_path: Path, *, database_url: str | None = None, headers: dict[str, str] | None = None,
          **settings_kw: Any) -> Iterator[Served]:
    """kmend serve on a free loopback port with the simulated cluster."""
    kw: dict[str, Any] = {"healer_interval_s": 0.05, "symptom_settle_s": 0.2, "detector_interval_s": 0.1}
    kw.update(settings_kw)
    settings = Settings(database_url=database_url or f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", **kw)
    kmend = make_kmend(settings, cluster=build_cluster(8))
    with serve_in_thread(create_app(kmend, settings)) as url, \
            httpx.Client(base_url=url, timeout=30, headers=headers or {}) as client:
        yield Served(client, kmend, url)
    kmend.store.close()
