"""Restart (and a failed batch) rebuild state from stored incidents quickly, whatever one incident's size."""

from __future__ import annotations

import time
from pathlib import Path

from healer.notify import LogNotifier
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID79, container, kernel, nccl_timeout

T0 = 1_700_000_000.0


def test_restart_with_5000_findings_in_one_incident_is_ready_quickly(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim")
    first = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier())
    first.start()
    # A flood: every rank of a 5,000-rank job times out (one line each) → one job-wide incident.
    for b in range(5):
        first.ingest([container(f"gpu-node-{r // 8:04d}", nccl_timeout(r), job="big", rank=r, ts=T0 + r * 0.01)
                      for r in range(b * 1000, (b + 1) * 1000)])
    [before] = first.incidents()
    assert len(before.findings) == 5000
    first.store.close()

    second = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier())
    # CPU seconds, not wall time: a loaded CI machine stretches the wall clock, not the work (replaying the
    # incident finding by finding took 6.6 s; restoring it as stored takes a fraction of a second).
    start = time.process_time()
    second.start()
    took = time.process_time() - start
    [after] = second.incidents()
    assert (after.id, after.state, len(after.findings)) == (before.id, before.state, 5000)
    assert after.root_cause == before.root_cause
    assert took < 2.0, f"restart took {took:.1f} CPU-s for one incident of 5,000 findings"
    second.store.close()


def test_restart_keeps_a_cause_that_arrived_after_its_symptoms_as_root(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim")
    first = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier())
    first.start()
    first.ingest([container(f"gpu-node-0{r // 8}", "iteration 1", job="j", rank=r, ts=T0) for r in range(0, 32, 8)])
    first.ingest([container(f"gpu-node-0{r // 8}", nccl_timeout(r), job="j", rank=r, ts=T0 + 600)
                  for r in range(0, 32, 8)])
    first.ingest([kernel("gpu-node-02", XID79, ts=T0 + 601)])
    [before] = first.incidents()
    assert before.root_cause.node == "gpu-node-02" and before.hardware
    first.store.close()

    second = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier())
    second.start()
    [after] = second.incidents()
    assert (after.id, after.root_cause, after.fault_class, len(after.findings)) == (
        before.id, before.root_cause, before.fault_class, len(before.findings))
    # A late symptom after the restart still joins the restored incident.
    second.ingest([container("gpu-node-03", nccl_timeout(25), job="j", rank=25, ts=T0 + 620)])
    [joined] = second.incidents()
    assert joined.id == before.id and len(joined.findings) == len(before.findings) + 1
    second.store.close()
