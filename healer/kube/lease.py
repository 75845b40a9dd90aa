"""KubeLeases: the Leases port on coordination.k8s.io/v1, through the official client.

A replace carries the resourceVersion last read; the API server answers 409 when another replica wrote
in between — the elector reads that as leadership lost.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from healer.kube.cluster import STRICT, translate
from healer.lease import LeaseConflict, LeaseRecord


class MicroTime(dt.datetime):
    """A datetime the client writes with six fractional digits, even when they are all zero.

    ``acquireTime``/``renewTime`` are MicroTime, which the API server parses as
    ``2006-01-02T15:04:05.000000Z07:00`` only; the client's ``isoformat()`` drops a zero fraction, so a
    renewal on a whole second would be refused with 400.
    """

    def isoformat(self, sep: str = "T", timespec: str = "auto") -> str:
        return super().isoformat(sep, "microseconds")


def _time(ts: float) -> dt.datetime:
    return MicroTime.fromtimestamp(ts, dt.UTC)


class KubeLeases:
    """Leases port on the Kubernetes API."""

    def __init__(self, api: client.ApiClient, *, request_timeout_s: float = 5.0) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.timeout = request_timeout_s

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        try:
            return self._record(self.coordination.read_namespaced_lease(name, namespace,
                                                                        _request_timeout=self.timeout))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise translate(exc) from exc

    def create(self, lease: LeaseRecord) -> LeaseRecord:
        return self._write(lambda body: self.coordination.create_namespaced_lease(
            lease.namespace, body, field_validation=STRICT, _request_timeout=self.timeout), lease)

    def update(self, lease: LeaseRecord) -> LeaseRecord:
        return self._write(lambda body: self.coordination.replace_namespaced_lease(
            lease.name, lease.namespace, body, field_validation=STRICT, _request_timeout=self.timeout), lease)

    def _write(self, fn: Any, lease: LeaseRecord) -> LeaseRecord:
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=lease.name, namespace=lease.namespace,
                                         resource_version=lease.resource_version or None),
            spec=client.V1LeaseSpec(holder_identity=lease.holder or None,
                                    lease_duration_seconds=lease.duration_s,
                                    acquire_time=_time(lease.acquire_time), renew_time=_time(lease.renew_time),
                                    lease_transitions=lease.transitions))
        try:
            return self._record(fn(body))
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(f"409 Conflict: lease {lease.namespace}/{lease.name}: {exc.reason}") from exc
            raise translate(exc) from exc
        except OSError as exc:
            raise translate(exc) from exc

    @staticmethod
    def _record(obj: Any) -> LeaseRecord:
        spec = obj.spec
        return LeaseRecord(
            name=obj.metadata.name, namespace=obj.metadata.namespace, holder=spec.holder_identity or "",
            duration_s=int(spec.lease_duration_seconds or 15),
            renew_time=spec.renew_time.timestamp() if spec.renew_time else 0.0,
            acquire_time=spec.acquire_time.timestamp() if spec.acquire_time else 0.0,
            transitions=int(spec.lease_transitions or 0), resource_version=obj.metadata.resource_version or "",
        )
