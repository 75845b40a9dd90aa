"""Quiet incidents resolve on their own in the service (notify-only ones included), stored and counted so;
an incident whose plan waits for approval stays open; the setting turns it off."""

from __future__ import annotations

from pathlib import Path

from healer.notify import LogNotifier
from healer.records import PlanState
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID13, XID79, kernel

T0 = 1_700_000_000.0


def _kmend(tmp_path: Path, quiet_s: float) -> Kmend:
    k = make_kmend(Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", require_approval=True,
                            incident_quiet_resolve_s=quiet_s), cluster=build_cluster(4), notifier=LogNotifier())
    k.start()
    return k


def _open_gauge(k: Kmend, fault_class: str) -> float:
    return k.metrics.registry.get_sample_value("kmend_incidents_open", {"fault_class": fault_class}) or 0.0


def test_a_notify_only_incident_resolves_when_quiet_and_one_awaiting_approval_stays_open(tmp_path: Path) -> None:
    k = _kmend(tmp_path, quiet_s=3600)
    [app] = k.ingest([kernel("gpu-node-00", XID13, ts=T0)]).incidents
    [lost] = k.ingest([kernel("gpu-node-01", XID79, ts=T0)]).incidents
    plans = {p.incident_id: p for p in k.heal_once()}
    assert plans[app.id].state is PlanState.SUCCEEDED  # the owner was told: nothing left to do
    assert plans[lost.id].state is PlanState.AWAITING_APPROVAL

    assert k.evaluate(now=T0 + 1800).incidents == ()  # not quiet long enough yet
    assert _open_gauge(k, "app_error") == 1

    [resolved] = k.evaluate(now=T0 + 3601).incidents
    assert resolved.id == app.id and resolved.state.value == "resolved"
    assert resolved.timeline[-1].what == "resolved: quiet for 3600 s"
    stored = {i["id"]: i["state"] for i in k.store.list_incidents()}
    assert stored == {app.id: "resolved", lost.id: "open"}
    assert _open_gauge(k, "app_error") == 0 and _open_gauge(k, "gpu_lost") == 1
    assert [i.id for i in k.analyzer.correlator.active()] == [lost.id]

    # The same fault later is a new incident; a restart keeps the quiet one resolved.
    [again] = k.ingest([kernel("gpu-node-00", XID13, ts=T0 + 7200)]).incidents
    assert again.id != app.id
    k.store.close()
    k2 = _kmend(tmp_path, quiet_s=3600)
    assert {i.id for i in k2.analyzer.correlator.active()} == {lost.id, again.id}
    k2.store.close()


def test_zero_keeps_quiet_incidents_open(tmp_path: Path) -> None:
    k = _kmend(tmp_path, quiet_s=0)
    k.ingest([kernel("gpu-node-00", XID13, ts=T0)])
    k.heal_once()
    assert k.evaluate(now=T0 + 10 * 86400).incidents == ()
    assert [i["state"] for i in k.store.list_incidents()] == ["open"]
    k.store.close()
