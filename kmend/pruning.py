"""Retention's own loop: rows past their time are deleted on a thread of their own, a backlog in paced passes.

In the healer loop, a backlog's prune (after a restart, an upgrade, a lowered retention) sat between a fault
and its cordon for as long as it took. Here each pass's transactions take at most `retention_share` of the
wall time and a pass ends after `retention_pass_s`; what it leaves goes on after `retention_rest_s`, and a
chunk holds the write queue for about 20 ms at most (``kmend.store.retention``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kmend.store.retention import Pace

if TYPE_CHECKING:
    from kmend.service import Kmend

log = logging.getLogger("kmend.service")


def prune_store(kmend: Kmend, pace: Pace | None = None) -> dict[str, int]:
    """Delete rows past their retention, at `pace`; returns rows deleted per table."""
    deleted = kmend.store.prune(kmend.healer.retention, pace)
    if deleted:
        log.info("retention: deleted %s", ", ".join(f"{n} {table}" for table, n in sorted(deleted.items())))
    return deleted


def run_retention(kmend: Kmend, stop: threading.Event) -> None:
    """Prune every `retention_interval_s` until `stop` is set, a backlog in passes; a failing pass is logged."""
    cfg = kmend.healer
    while not stop.is_set():
        pace = Pace(share=cfg.retention_share, pass_s=cfg.retention_pass_s, stop=stop.is_set)
        try:
            prune_store(kmend, pace)
        except Exception:
            log.exception("pruning the store failed")
        stop.wait(cfg.retention_rest_s if pace.cut_short else cfg.retention_interval_s)
