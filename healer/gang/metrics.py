"""Prometheus metrics of the gang scheduler, on a registry the caller passes in (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Cycles run from a millisecond (nothing changed) to seconds (a relist of a big cluster).
_CYCLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SchedulerMetrics:
    """One line per metric, with help text; counted only on the replica holding the Lease."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
