"""Scheduler settings: names, label keys and policy knobs, all with the defaults kmend ships."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Level(IntEnum):
    """Topology levels, narrowest first; a gang spanning fewer, narrower domains is closer."""

    LEAF = 0
    SPINE = 1
    ZONE = 2
    CLUSTER = 3


@dataclass(frozen=True, slots=True)
class TopologyKeys:
    """Node label keys that name a node's network domains."""

    leaf: str = "topology.kmend.io/leaf"
    """Leaf (top-of-rack) switch."""
    spine: str = "topology.kmend.io/spine"
    """Spine switch above the leaf."""
    zone: str = "topology.kmend.io/zone"
    """Zone or pod of spines."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the gang scheduler behaves."""

    scheduler_name: str = "kmend"
    """Pods with this ``spec.schedulerName`` are ours."""
    topology: TopologyKeys = TopologyKeys()
    """Label keys of the topology levels."""
    spare_label: str = "kmend.io/spare"
    """A node labelled ``<spare_label>=true`` belongs to the hot-spare pool."""
    spare_taint: str = "kmend.io/spare"
    """Taint key that keeps ordinary pods off spares; waived only for replacements."""
    default_schedule_timeout_s: float = 60.0
    """Wait for a partly bound gang when its PodGroup sets no ``scheduleTimeoutSeconds``."""
    reservation_hold_s: float = 900.0
    """How long a restarting gang's capacity stays held when the healer gives no expiry."""
    bind_workers: int = 8
    """Parallel Binding calls per gang: one API round trip each, so a big gang needs many."""
    bind_attempts: int = 2
    """Attempts per binding on a retryable error before the gang is released."""
    event_repeat_s: float = 60.0
    """Repeat an unchanged "cannot schedule" event at most this often."""
    wake_settle_s: float = 0.01
    """After the watch wakes the scheduler, wait this long for the rest of a burst of pods before the cycle."""
