"""A slow batch (a slow database commit) must not stall other requests: /healthz answers meanwhile."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.wire import to_wire
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import container

T0 = 1_700_000_000.0
SLOW_S = 1.5


@pytest.fixture
def slow_server(tmp_path: Path) -> Iterator[tuple[str, threading.Event]]:
    """A served kmend whose store takes SLOW_S to commit each batch; the event is set once one is inside."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", healer_interval_s=60)
    kmend = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    inside = threading.Event()
    real_ingest = kmend.store.ingest

    def slow_ingest(*args: Any, **kw: Any) -> Any:
        inside.set()
        time.sleep(SLOW_S)  # stands in for a commit waiting on a busy database
        return real_ingest(*args, **kw)

    kmend.store.ingest = slow_ingest  # type: ignore[method-assign]
    with serve_in_thread(create_app(kmend, settings, run_healer=False)) as url:
        yield url, inside
    kmend.store.close()


def _while_slow(url: str, inside: threading.Event, post: Callable[[httpx.Client], httpx.Response]) -> float:
    """Median seconds /healthz took while `post` was inside the slow store; the post itself must succeed.

    Only answers that came back while the batch was still in the store count, and there must be
    several: a blocked loop answers none of them until the batch is done.
    """
    results: list[httpx.Response] = []
    with httpx.Client(base_url=url, timeout=10) as client, httpx.Client(base_url=url, timeout=10) as probe:
        assert probe.get("/healthz").status_code == 200  # connection open before the slow batch starts
        t = threading.Thread(target=lambda: results.append(post(client)))
        t.start()
        assert inside.wait(5), "the batch never reached the store"
        during: list[float] = []
        while t.is_alive():
            start = time.monotonic()
            r = probe.get("/healthz", timeout=5)
            took = time.monotonic() - start
            assert r.status_code == 200
            if t.is_alive():
                during.append(took)
            time.sleep(0.02)
        t.join(10)
    assert results and results[0].status_code == 200, results
    assert len(during) >= 3, f"/healthz answered {len(during)} times in {SLOW_S} s behind a slow batch"
    return statistics.median(during)


def test_healthz_answers_within_100ms_while_a_slow_signal_batch_is_ingested(
        slow_server: tuple[str, threading.Event]) -> None:
    url, inside = slow_server
    batch = {"signals": [to_wire(container("gpu-node-00", f"iteration {i}", rank=0, ts=T0 + i)) for i in range(5)]}
    median = _while_slow(url, inside, lambda c: c.post("/v1/signals", json=batch))
    assert median < 0.1, f"/healthz took {median:.3f} s (median) behind a slow batch"


def test_healthz_answers_within_100ms_while_a_slow_fluentbit_batch_is_ingested(
        slow_server: tuple[str, threading.Event]) -> None:
    url, inside = slow_server
    records = [{"date": T0 + i, "log": f"iteration {i}", "kubernetes": {"host": "gpu-node-00", "pod_name": "p",
                                                                        "namespace_name": "ml", "container_name": "c"}}
               for i in range(5)]
    median = _while_slow(url, inside, lambda c: c.post("/v1/ingest/fluentbit", json=records))
    assert median < 0.1, f"/healthz took {median:.3f} s (median) behind a slow batch"
