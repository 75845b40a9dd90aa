"""Prometheus metrics of the gang scheduler, on a registry the caller passes in (no globals).

``prometheus_client`` is imported when the metrics are built, not with this module: `kmend serve` starts the scheduler
on ``HeldMetrics`` and builds the registry after the first cycle's binds (its import is a tenth of a second that a gang
waiting at start would wait for), and the held cycles are counted then.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

# Cycles run from a millisecond (nothing changed) to seconds (a relist of a big cluster).
_CYCLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class CycleMetrics(Protocol):
    """What the scheduler records."""

    def observe(self, seconds: float, pending: int, *, placed: int, bound: int) -> None:
        """Record one cycle."""
        ...

    def failed_binds(self, count: int) -> None:
        """Count bindings that failed or may not have taken effect."""
        ...


class SchedulerMetrics:
    """One line per metric, with help text; counted only on the replica holding the Lease."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = registry
        """Where the metrics are registered."""
        r = registry
        self.cycle_seconds = Histogram("kmend_scheduler_cycle_duration_seconds",
                                       "Wall time of one scheduling cycle, binds included",
                                       buckets=_CYCLE_BUCKETS, registry=r)
        self.gangs_placed = Counter("kmend_scheduler_gangs_placed_total",
                                    "Gangs placed and bound whole", registry=r)
        self.pods_bound = Counter("kmend_scheduler_pods_bound_total",
                                  "Pods bound through the Binding API as members of a whole gang", registry=r)
        self.bind_failures = Counter("kmend_scheduler_bind_failures_total",
                                     "Binding calls that failed or may not have taken effect", registry=r)
        self.gangs_pending = Gauge("kmend_scheduler_gangs_pending",
                                   "Gangs still waiting for room after the last cycle", registry=r)

    def observe(self, seconds: float, pending: int, *, placed: int, bound: int) -> None:
        """Record one cycle."""
        self.cycle_seconds.observe(seconds)
        self.gangs_placed.inc(placed)
        self.pods_bound.inc(bound)
        self.gangs_pending.set(pending)

    def failed_binds(self, count: int) -> None:
        """Count bindings that failed or may not have taken effect."""
        self.bind_failures.inc(count)


class HeldMetrics:
    """Cycles recorded before the registry exists; once ``attach``-ed, replayed into it and passed on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[float, int, int, int]] = []
        self._failed = 0
        self._to: CycleMetrics | None = None

    def observe(self, seconds: float, pending: int, *, placed: int, bound: int) -> None:
        """Record one cycle (held until attached)."""
        with self._lock:
            if self._to is None:
                self._held.append((seconds, pending, placed, bound))
                return
        self._to.observe(seconds, pending, placed=placed, bound=bound)

    def failed_binds(self, count: int) -> None:
        """Count failed bindings (held until attached)."""
        with self._lock:
            if self._to is None:
                self._failed += count
                return
        self._to.failed_binds(count)

    def attach(self, to: CycleMetrics) -> None:
        """Replay what was held into ``to``; every later record goes straight there."""
        with self._lock:
            for seconds, pending, placed, bound in self._held:
                to.observe(seconds, pending, placed=placed, bound=bound)
            if self._failed:
                to.failed_binds(self._failed)
            self._held, self._failed, self._to = [], 0, to
