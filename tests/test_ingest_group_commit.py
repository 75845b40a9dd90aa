"""Numbered batches are committed after the ingest lock is let go (group commit): a slow commit stalls neither
/healthz nor the next batch's analysis, every answer waits for its own batch to be durable, and a failed group
leaves no incident behind that was never stored."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.exc import IntegrityError

from collector.shipper import encode_batch
from collector.signal import Signal
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID79, container, kernel

T0 = 1_700_000_000.0
GZIP = {"Content-Type": "application/json", "Content-Encoding": "gzip"}


def _wait(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _batch(node: str, n: int, *, xid: bool = False) -> list[Signal]:
    sigs = [container(node, f"iteration {i} loss 1.25", rank=0, ts=T0 + i) for i in range(n)]
    return [*sigs, kernel(node, XID79, ts=T0 + n)] if xid else sigs


class Gate:
    """Holds the first `held` line inserts of the store's commit until released; counts those that came."""

    def __init__(self, kmend: Kmend, held: int = 1) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self._held = held
        real = kmend.store._insert_lines

        def gated(conn: Any, sigs: Any) -> None:
            self.calls += 1
            if self.calls <= self._held:
                self.entered.set()
                assert self.release.wait(60), "the test never released the commit"
            real(conn, sigs)

        kmend.store._insert_lines = gated  # type: ignore[method-assign]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Kmend, str]]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", healer_interval_s=60)
    kmend = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier())
    with serve_in_thread(create_app(kmend, settings, run_healer=False)) as url:
        yield kmend, url
    kmend.store.close()


def _post_in_thread(url: str, body: bytes, out: list[httpx.Response]) -> threading.Thread:
    def post() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            out.append(c.post("/v1/signals", content=body, headers=GZIP))
    t = threading.Thread(target=post)
    t.start()
    return t


def test_a_slow_commit_stalls_neither_healthz_nor_the_next_batchs_analysis(served: tuple[Kmend, str]) -> None:
    kmend, url = served
    gate = Gate(kmend)
    first: list[httpx.Response] = []
    second: list[httpx.Response] = []
    t1 = _post_in_thread(url, encode_batch(_batch("gpu-node-01", 50), producer="gpu-node-01/agent", seq=1), first)
    assert gate.entered.wait(30), "the first batch never reached its commit"
    with httpx.Client(base_url=url, timeout=5) as probe:
        started = time.monotonic()
        assert probe.get("/healthz").status_code == 200
        assert time.monotonic() - started < 1.0, "/healthz waited for a commit"
    t2 = _post_in_thread(url, encode_batch(_batch("gpu-node-02", 50, xid=True), producer="gpu-node-02/agent", seq=1),
                         second)
    # The second batch is decoded and analysed while the first one's commit is held: its Xid is an incident.
    _wait(lambda: any(i.root_cause.node == "gpu-node-02" for i in kmend.incidents()),
          "the second batch's analysis, while the first batch's commit was held")
    time.sleep(0.2)
    assert not first and not second, "a batch was answered before it was durable"
    assert kmend.store.count_signals() == 0
    gate.release.set()
    t1.join(60)
    t2.join(60)
    assert [r.status_code for r in first + second] == [200, 200], first + second
    assert first[0].json()["accepted"] == 50 and second[0].json()["incidents"]
    assert kmend.store.count_signals() == 101
    stored = kmend.store.list_incidents(node="gpu-node-02")
    assert [i["id"] for i in stored] == second[0].json()["incidents"]


def test_a_replay_of_a_batch_still_being_committed_waits_for_it_and_is_taken_once(served: tuple[Kmend, str]) -> None:
    kmend, url = served
    gate = Gate(kmend)
    body = encode_batch(_batch("gpu-node-01", 20, xid=True), producer="gpu-node-01/agent", seq=7)
    first: list[httpx.Response] = []
    again: list[httpx.Response] = []
    t1 = _post_in_thread(url, body, first)
    assert gate.entered.wait(30)
    t2 = _post_in_thread(url, body, again)
    time.sleep(0.3)
    assert not again, "the replay was answered before the batch it repeats was durable"
    gate.release.set()
    t1.join(60)
    t2.join(60)
    answers = sorted((r.json()["accepted"], r.json()["duplicates"]) for r in first + again)
    assert answers == [(0, 21), (21, 0)], answers
    assert kmend.store.count_signals() == 21
    assert len(kmend.store.findings_in_order()) == 1
    assert gate.calls == 1, "the replay was written again"


def test_a_failed_group_fails_every_batch_in_it_and_leaves_no_incident_that_was_never_stored(
        served: tuple[Kmend, str]) -> None:
    kmend, url = served
    gate = Gate(kmend)
    real_results = kmend.store._write_results
    failures = [1]

    def failing(*args: Any, **kw: Any) -> None:
        if failures[0] > 0:  # inside the held group's transaction, and not transient: no retry
            failures[0] -= 1
            raise IntegrityError("INSERT INTO findings", {}, Exception("constraint failed"))
        real_results(*args, **kw)

    kmend.store._write_results = failing  # type: ignore[method-assign]
    first: list[httpx.Response] = []
    second: list[httpx.Response] = []
    t1 = _post_in_thread(url, encode_batch(_batch("gpu-node-01", 5, xid=True), producer="a", seq=1), first)
    assert gate.entered.wait(30)
    t2 = _post_in_thread(url, encode_batch(_batch("gpu-node-02", 5, xid=True), producer="b", seq=1), second)
    _wait(lambda: len(kmend.incidents()) == 2, "the second batch's analysis")
    gate.release.set()
    t1.join(60)
    t2.join(60)
    # The second batch was analysed on top of the first one's unstored findings: it fails with it.
    assert [r.status_code for r in first + second] == [500, 500]
    assert kmend.incidents() == [], "an incident that was never stored is still in memory"
    assert kmend.store.count_signals() == 0 and kmend.store.findings_in_order() == []
    # The agents send again: each batch is taken once, as if the failure never happened.
    with httpx.Client(base_url=url, timeout=60) as c:
        for node, producer in (("gpu-node-01", "a"), ("gpu-node-02", "b")):
            r = c.post("/v1/signals", content=encode_batch(_batch(node, 5, xid=True), producer=producer, seq=1),
                       headers=GZIP)
            assert r.status_code == 200
    assert sorted(i.root_cause.node for i in kmend.incidents()) == ["gpu-node-01", "gpu-node-02"]
    assert len(kmend.store.findings_in_order()) == 2
    assert kmend.store.count_signals() == 12


def test_producer_marks_kept_in_memory_are_bounded_and_a_replay_is_still_recognised_after(
        served: tuple[Kmend, str], monkeypatch: pytest.MonkeyPatch) -> None:
    kmend, _ = served
    monkeypatch.setattr("kmend.grouped.MAX_CLAIMS", 3)
    batches = {f"gpu-node-0{p}/agent-{p}": _batch(f"gpu-node-0{p}", 3) for p in range(8)}
    for producer, sigs in batches.items():  # an agent restarting takes a new producer id each time
        assert kmend.ingest(sigs, (producer, 1)).accepted == 3
        assert len(kmend.grouped.claims) <= 4
    for producer, sigs in batches.items():
        again = kmend.ingest(sigs, (producer, 1))
        assert (again.accepted, again.duplicates) == (0, 3), producer
    assert kmend.store.count_signals() == 24
