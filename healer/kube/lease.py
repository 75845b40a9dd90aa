"""KubeLeases: the Leases port on coordination.k8s.io/v1, with plain dicts through ``healer.kube.rest``.

A replace carries the resourceVersion last read; the API server answers 409 when another replica wrote
in between — the elector reads that as leadership lost. The Lease is the first thing `kmend serve` asks of a real
cluster, before the gang scheduler may act: it goes without the generated API classes and models (their import and
pydantic validators cost more than the requests).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import urllib3
from kubernetes.client.api_client import ApiClient
from kubernetes.client.exceptions import ApiException

from healer.kube.cluster import STRICT, translate
from healer.kube.rest import Rest, path
from healer.lease import LeaseConflict, LeaseRecord


def micro_time(ts: float) -> str:
    """``acquireTime``/``renewTime`` as MicroTime: six fractional digits, always.

    The API server parses MicroTime as ``2006-01-02T15:04:05.000000Z07:00`` only, so a time on a whole second
    written without its fraction would be refused with 400.
    """
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seconds(text: str | None) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else 0.0


class KubeLeases:
    """Leases port on the Kubernetes API."""

    def __init__(self, api: ApiClient, *, request_timeout_s: float = 5.0) -> None:
        self.rest = Rest(api)
        self.timeout = request_timeout_s

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        try:
            return self._record(json.loads(self.rest.call("GET", self._path(namespace, name), timeout=self.timeout)))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise translate(exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # no answer: refused, reset, timed out
            raise translate(exc) from exc

    def create(self, lease: LeaseRecord) -> LeaseRecord:
        return self._write("POST", self._path(lease.namespace), lease)

    def update(self, lease: LeaseRecord) -> LeaseRecord:
        return self._write("PUT", self._path(lease.namespace, lease.name), lease)

    @staticmethod
    def _path(namespace: str, *name: str) -> str:
        return path("apis", "coordination.k8s.io", "v1", "namespaces", namespace, "leases", *name)

    def _write(self, method: str, where: str, lease: LeaseRecord) -> LeaseRecord:
        meta: dict[str, Any] = {"name": lease.name, "namespace": lease.namespace}
        if lease.resource_version:
            meta["resourceVersion"] = lease.resource_version
        spec: dict[str, Any] = {"leaseDurationSeconds": lease.duration_s, "acquireTime": micro_time(lease.acquire_time),
                                "renewTime": micro_time(lease.renew_time), "leaseTransitions": lease.transitions}
        if lease.holder:
            spec["holderIdentity"] = lease.holder
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
        try:
            return self._record(json.loads(self.rest.call(method, where, query={"fieldValidation": STRICT}, body=body,
                                                          timeout=self.timeout)))
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(f"409 Conflict: lease {lease.namespace}/{lease.name}: {exc.reason}") from exc
            raise translate(exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:  # no answer: refused, reset, timed out
            raise translate(exc) from exc

    @staticmethod
    def _record(obj: dict[str, Any]) -> LeaseRecord:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        return LeaseRecord(
            name=meta.get("name", ""), namespace=meta.get("namespace", ""), holder=spec.get("holderIdentity") or "",
            duration_s=int(spec.get("leaseDurationSeconds") or 15), renew_time=_seconds(spec.get("renewTime")),
            acquire_time=_seconds(spec.get("acquireTime")), transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=meta.get("resourceVersion") or "",
        )
