"""Leader election on a coordination.k8s.io Lease: only the replica holding it heals and schedules.

Renewal writes with the last resourceVersion seen; a 409 means another replica wrote in between, and
leadership is lost at once (the caller stops acting before its next step).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from healer.cluster import ClusterError, TemporaryError
from healer.reach import Repeats, unreachable

log = logging.getLogger("kmend.lease")


class LeaseConflict(TemporaryError):
    """409 Conflict: the lease exists already, or changed since it was read."""


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A Lease object."""

    name: str
    """Lease name."""
    namespace: str
    """Namespace."""
    holder: str
    """``spec.holderIdentity``."""
    duration_s: int
    """``spec.leaseDurationSeconds``."""
    renew_time: float
    """``spec.renewTime``, seconds since the epoch."""
    acquire_time: float
    """``spec.acquireTime``."""
    transitions: int = 0
    """``spec.leaseTransitions``."""
    resource_version: str = ""
    """``metadata.resourceVersion`` as read (empty for a new object)."""


class Leases(Protocol):
    """Lease objects of the coordination.k8s.io API.

    Guarantees: ``create`` raises ``LeaseConflict`` when the lease exists; ``update`` raises
    ``LeaseConflict`` when ``resource_version`` is not the stored one; both return the stored record with
    its new resourceVersion; ``get`` returns None for a missing lease.
    """

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        """The lease, or None."""
        ...

    def create(self, lease: LeaseRecord) -> LeaseRecord:
        """Create it."""
        ...

    def update(self, lease: LeaseRecord) -> LeaseRecord:
        """Replace it, guarded by its resourceVersion."""
        ...


class Leader(Protocol):
    """Whether this replica may act (``LeaderElector`` or ``AlwaysLeader``)."""

    def is_leader(self) -> bool:
        """True while this replica holds the lease."""
        ...

    def tick(self) -> bool:
        """Acquire or renew; returns is_leader afterwards."""
        ...


class LeaderElector:
    """Acquires and renews one Lease; ``is_leader`` is true only while a renewal is fresh.

    A held lease is renewed once it is ``renew_s`` old (client-go's retry period), not on every
    tick: the healer ticks before each round, and a write per round would sit in front of every cordon.
    """

    def __init__(self, leases: Leases, *, namespace: str, name: str, identity: str, duration_s: int = 15,
                 clock: Callable[[], float], renew_s: float = 2.0) -> None:
        self.leases = leases
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration_s = duration_s
        self.clock = clock
        self.renew_s = min(renew_s, duration_s / 3)
        self._held: LeaseRecord | None = None
        self._ticking = threading.Lock()
        self.on_change: Callable[[LeaseRecord | None], None] | None = None
        self._repeats = Repeats()

    def is_leader(self) -> bool:
        """Holding the lease, renewed within its duration by the local clock."""
        held = self._held
        return held is not None and self.clock() - held.renew_time < held.duration_s

    @property
    def observed(self) -> LeaseRecord | None:
        """The lease as last written by this replica, if it holds it."""
        return self._held

    def tick(self) -> bool:
        """Acquire or renew once; returns whether this replica leads afterwards (one tick at a time)."""
        with self._ticking:
            return self._tick()

    def _tick(self) -> bool:
        now = self.clock()
        try:
            if self._held is not None:
                if now - self._held.renew_time < self.renew_s:
                    return True
                self._set(self.leases.update(replace(self._held, renew_time=now)))
                return True
            current = self.leases.get(self.namespace, self.name)
            if current is None:
                self._set(self.leases.create(LeaseRecord(self.name, self.namespace, self.identity,
                                                         self.duration_s, now, now)))
                return True
            expired = now - current.renew_time >= current.duration_s
            if current.holder == self.identity or expired or not current.holder:
                transitions = current.transitions + (current.holder != self.identity)
                self._set(self.leases.update(replace(current, holder=self.identity, renew_time=now,
                                                     acquire_time=now, duration_s=self.duration_s,
                                                     transitions=transitions)))
                return True
            return False
        except LeaseConflict as exc:
            if self._held is not None:
                log.warning("lost leadership of lease %s/%s: %s", self.namespace, self.name, exc)
            self._set(None)
            return False
        except ClusterError as exc:
            # Without a successful renewal the lease lapses by itself; keep acting only while it is fresh. An API
            # server that does not answer is said once by the client (``healer.reach``), not on every tick; any
            # other error (a 403) is said when it first comes and when it changes.
            if not unreachable(exc) and self._repeats.new(exc):
                log.warning("could not renew lease %s/%s: %s", self.namespace, self.name, exc)
            return self.is_leader()

    def release(self) -> None:
        """Give the lease up (on shutdown) so another replica takes over at once."""
        if self._held is None:
            return
        with contextlib.suppress(ClusterError):
            self.leases.update(replace(self._held, holder="", renew_time=self.clock()))
        self._set(None)

    def _set(self, lease: LeaseRecord | None) -> None:
        if lease is not None:
            self._repeats.cleared()
        changed = (lease is None) != (self._held is None)
        self._held = lease
        if changed and self.on_change is not None:
            self.on_change(lease)


class AlwaysLeader:
    """A single replica that never competes (tests, the embedded demo)."""

    def is_leader(self) -> bool:
        """Always."""
        return True

    def tick(self) -> bool:
        """Nothing to renew."""
        return True
