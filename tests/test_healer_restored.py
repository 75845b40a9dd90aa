"""Incidents found open at start: the healer plans for them a bounded slice a round (a small first one, each after it
at most twice the last), after every new incident, never plans again for one that has a plan, and still plans for every
one of them within a few rounds, in the running service's loop too (planned all at once, a hundred held the core the
first ingested batches needed)."""

from __future__ import annotations

import threading
from pathlib import Path

from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID13, kernel
from tests.hostile import wait_for

T0 = 1_700_000_000.0
OPEN = 40
"""Incidents open at the restart with no plan yet."""
PLANNED = 2
"""Incidents open at the restart whose plans were made before it."""
SLICE = 8
"""The most of them the first round plans for (``Healing(restored_per_round=)``, as shipped)."""


def _restart(tmp_path: Path, **settings_kw: float) -> tuple[Kmend, Settings, dict[str, object]]:
    """A service restarted on a store holding PLANNED open incidents with plans and OPEN without; the first
    service's plans, as stored."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", incident_quiet_resolve_s=0,
                        **settings_kw)
    first = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    first.start()
    # Notify-only faults on nodes of their own: one incident each.
    first.ingest([kernel(f"gpu-node-x{i:03d}", XID13, ts=T0 + i) for i in range(PLANNED)])
    first.heal_once()
    before = {p.id: p for p in first.store.list_plans()}
    assert len(before) == PLANNED
    first.ingest([kernel(f"gpu-node-y{i:03d}", XID13, ts=T0 + 100 + i) for i in range(OPEN)])
    first.store.close()
    k = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    k.start()
    assert len(k.analyzer.correlator.active()) == PLANNED + OPEN
    return k, settings, dict(before)


def _background_done(k: Kmend) -> None:
    """Until the quarantines that went on in the background have ended (they log as they end)."""
    bg = k.healing.background
    wait_for(lambda: all(bg.stop_of(pid) is None for pid in bg.running()), timeout=60)


def test_a_round_plans_a_bounded_slice_of_the_incidents_found_open_at_start_after_the_new_ones(
        tmp_path: Path) -> None:
    k, _, before = _restart(tmp_path)
    # A fault after the restart, of the same severity as the waiting ones and newer than all of them.
    k.ingest([kernel("gpu-node-01", XID13, ts=T0 + 1000)])
    live = next(i for i in k.analyzer.correlator.active() if i.root_cause.node == "gpu-node-01")
    made: list[list[str]] = []
    seen = set(before)
    for _ in range(5):
        k.heal_once(detach=True)
        now = {p.id: p for p in k.store.list_plans()}
        made.append(sorted(now.keys() - seen))
        seen |= now.keys()
    # The new fault first: planned in the first round, not behind the forty older ones.
    assert any(p.incident_id == live.id for p in k.store.list_plans() if p.id in made[0])
    # Each round plans at most its slice of those found open at start (the new one besides): 8, then 16, 16.
    assert len(made[0]) <= SLICE + 1, [len(m) for m in made]
    assert all(len(m) <= SLICE * 2 ** i for i, m in enumerate(made[1:], 1)), [len(m) for m in made]
    assert sum(map(len, made[:3])) == OPEN + 1, [len(m) for m in made]
    # Every one of them is planned within a few rounds, each once; the plans made before the restart are as they were.
    plans = {p.id: p for p in k.store.list_plans()}
    assert len(plans) == PLANNED + OPEN + 1
    assert len({p.incident_id for p in plans.values()}) == PLANNED + OPEN + 1
    assert all(plans[pid] == plan for pid, plan in before.items())
    assert k.healing.restored.left == 0 and not k.healing.restored.ids
    _background_done(k)
    k.store.close()


def test_the_running_loop_plans_for_them_in_slices_without_waiting_its_period_between(tmp_path: Path) -> None:
    """The loop's period is long here: the slices follow each other at the loop's pace, not once a period."""
    interval_s = 30.0
    k, settings, _ = _restart(tmp_path, healer_interval_s=interval_s)
    rounds: list[int] = []
    lock = threading.Lock()
    heal = k.healing.heal_once

    def counted(*args: object, **kw: object) -> object:
        before = len(k.store.plan_ids())
        out = heal(*args, **kw)  # type: ignore[arg-type]
        with lock:
            rounds.append(len(k.store.plan_ids()) - before)
        return out

    k.healing.heal_once = counted  # type: ignore[method-assign]
    with serve_in_thread(create_app(k, settings)):
        wait_for(lambda: len(k.store.plan_ids()) == PLANNED + OPEN, timeout=interval_s)
    with lock:
        planned = [n for n in rounds if n]
        assert all(n <= SLICE * 2 ** i for i, n in enumerate(planned)), rounds
    _background_done(k)
    k.store.close()
