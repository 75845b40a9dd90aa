"""SimLeases: coordination.k8s.io Leases in memory, with the API server's 409 on a stale resourceVersion."""

from __future__ import annotations

import threading
from dataclasses import replace

from healer.lease import LeaseConflict, LeaseRecord


class SimLeases:
    """In-memory implementation of the Leases port (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[tuple[str, str], LeaseRecord] = {}
        self._rv = 100

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        with self._lock:
            return self._leases.get((namespace, name))

    def create(self, lease: LeaseRecord) -> LeaseRecord:
        with self._lock:
            key = (lease.namespace, lease.name)
            if key in self._leases:
                raise LeaseConflict(f'409 Conflict: leases.coordination.k8s.io "{lease.name}" already exists')
            return self._store(key, lease)

    def update(self, lease: LeaseRecord) -> LeaseRecord:
        with self._lock:
            key = (lease.namespace, lease.name)
            current = self._leases.get(key)
            if current is None or current.resource_version != lease.resource_version:
                raise LeaseConflict(f'409 Conflict: Operation cannot be fulfilled on leases.coordination.k8s.io '
                                    f'"{lease.name}": the object has been modified; please apply your changes '
                                    'to the latest version and try again')
            return self._store(key, lease)

    def _store(self, key: tuple[str, str], lease: LeaseRecord) -> LeaseRecord:
        self._rv += 1
        stored = replace(lease, resource_version=str(self._rv))
        self._leases[key] = stored
        return stored
