"""Bounded ingest queue: a batch that would wait past KMEND_INGEST_QUEUE_S is answered 503 with Retry-After at
once; the agent keeps it, waits as told, and sends it again, and the service takes it exactly once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from collector.metrics import AgentMetrics
from collector.shipper import Shipper, encode_batch
from collector.spool import DiskSpool
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.store import schema
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import container

T0 = 1_700_000_000.0
BUDGET_S = 0.3


class Clock:
    """The agent's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Kmend]]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", healer_interval_s=60,
                        ingest_queue_s=BUDGET_S)
    kmend = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    with serve_in_thread(create_app(kmend, settings, run_healer=False)) as url:
        yield url, kmend
    kmend.store.close()


def _wait_for(cond: object, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _stored(kmend: Kmend, node: str) -> int:
    with kmend.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(schema.signals)
                                .where(schema.signals.c.node == node)).scalar_one())


def test_batch_past_the_queue_budget_is_answered_503_and_resent_once(served: tuple[str, Kmend],
                                                                       tmp_path: Path) -> None:
    url, kmend = served
    # A batch in progress that does not end (it waits for the service lock, which the test holds).
    slow_body = encode_batch([container("node-a", f"line {i}", ts=T0 + i) for i in range(3)],
                             producer="node-a/agent", seq=1)
    slow: list[httpx.Response] = []
    clock = Clock()
    shipper = Shipper(url=url, spool=DiskSpool(tmp_path / "spool"), metrics=AgentMetrics(), clock=clock,
                      timeout=30.0, producer="node-b/agent")
    lines = [container("node-b", f"rank 0 line {i}", ts=T0 + i) for i in range(5)]
    kmend._lock.acquire()
    try:
        poster = threading.Thread(target=lambda: slow.append(httpx.post(
            url + "/v1/signals", content=slow_body, timeout=60,
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})))
        poster.start()
        _wait_for(lambda: kmend.grouped.turnstile.expected_wait() > BUDGET_S,
                  "the first batch never took its turn")
        answered: list[list[object]] = []
        agent = threading.Thread(target=lambda: answered.append(list(shipper.deliver(lines))))
        agent.start()
        agent.join(10)
        # Answered at once while the batch ahead still holds its turn, not after it.
        assert answered == [[]], "the agent's batch queued behind the stuck one instead of being answered"
        assert not slow, "the batch ahead was not still in progress"
        assert shipper.spool.signals == len(lines), "the refused batch is kept in the agent's spool"
        assert shipper.metrics.ship_errors._value.get() == 1
        assert not shipper.reachable, "the agent waits before sending again"
        other = httpx.post(url + "/v1/signals", timeout=10, content=encode_batch(
            [container("node-c", "line", ts=T0)], producer="node-c/agent", seq=1),
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert other.status_code == 503 and int(other.headers["retry-after"]) >= 1
        assert "KMEND_INGEST_QUEUE_S" in other.json()["detail"]
    finally:
        kmend._lock.release()
    poster.join(30)
    assert slow and slow[0].status_code == 200
    assert kmend.metrics.busy._value.get() == 2
    assert _stored(kmend, "node-b") == 0, "nothing of the refused batch was taken"

    clock.now += 1.0
    assert shipper.replay(), "the spooled batch was sent again and accepted"
    assert shipper.spool.signals == 0
    assert _stored(kmend, "node-b") == len(lines)
    assert shipper.replay() and _stored(kmend, "node-b") == len(lines), "sent once: nothing more to send"
    assert kmend.metrics.duplicates._value.get() == 0
    assert kmend.metrics.busy._value.get() == 2
