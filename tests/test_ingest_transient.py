"""A transient database error during ingest is retried; it never triggers a full rebuild or double analysis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from healer.notify import LogNotifier
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID79, kernel

T0 = 1_700_000_000.0


@pytest.fixture
def kmend(tmp_path: Path) -> Iterator[Kmend]:
    k = make_kmend(Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim"),
                   cluster=build_cluster(4), notifier=LogNotifier())
    k.start()
    yield k
    k.store.close()


def _fail_writes(kmend: Kmend, monkeypatch: pytest.MonkeyPatch, times: int) -> list[int]:
    """Make the first `times` result writes fail as a dropped connection does; returns the rebuild counter."""
    real = kmend.store._write_results
    left = [times]

    def flaky(*args: Any, **kw: Any) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise OperationalError("INSERT INTO findings", {}, Exception("server closed the connection unexpectedly"))
        real(*args, **kw)

    monkeypatch.setattr(kmend.store, "_write_results", flaky)
    rebuilds = [0]
    real_rebuild = kmend.rebuild

    def counted() -> None:
        rebuilds[0] += 1
        real_rebuild()

    monkeypatch.setattr(kmend, "rebuild", counted)
    return rebuilds


def test_a_transient_database_error_is_retried_without_rebuild(kmend: Kmend, monkeypatch: pytest.MonkeyPatch) -> None:
    rebuilds = _fail_writes(kmend, monkeypatch, times=2)
    analysed: list[int] = []
    real_process = kmend.analyzer.process
    monkeypatch.setattr(kmend.analyzer, "process", lambda s: analysed.append(len(s)) or real_process(s))

    outcome = kmend.ingest([kernel("gpu-node-01", XID79, ts=T0)])

    assert outcome.accepted == 1 and len(outcome.findings) == 1 and len(outcome.incidents) == 1
    assert rebuilds[0] == 0, "a transient error rebuilt the whole state"
    assert analysed == [1], "the batch was analysed more than once"
    stored = kmend.store.findings_in_order()
    assert [f.id for f in stored] == [outcome.findings[0].id]
    assert [i.id for i in kmend.incidents()] == [outcome.incidents[0].id]
    assert set(kmend.store.incident_states()) == {outcome.incidents[0].id}


def test_a_lasting_database_error_still_fails_the_batch_and_leaves_no_ghost_incident(
        kmend: Kmend, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_writes(kmend, monkeypatch, times=100)
    with pytest.raises(OperationalError):
        kmend.ingest([kernel("gpu-node-01", XID79, ts=T0)])
    assert kmend.incidents() == [], "an incident that was never stored is still in memory"
    assert kmend.store.findings_in_order() == []
