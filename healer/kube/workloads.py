"""KubeWorkloads: the Workloads port on a real API server, through the official client.

Evictions go through ``pods/eviction`` (policy/v1) so PodDisruptionBudgets hold: a 429 is a
``TemporaryError`` and nothing falls back to delete. Creates treat 409 AlreadyExists as done (a retry
after a timeout or a crash), deletes treat 404 as done. Custom resources (PyTorchJob, JobSet, Volcano
Job and Command) are read and patched through the CustomObjects API with JSON merge patches, which they
accept (strategic merge is for built-in kinds only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from healer.cluster import NotFoundError
from healer.kube.cluster import STRICT, call_api, create_once, translate
from healer.workloads import ObjectKey, OwnerRef, PodInfo

MERGE_PATCH = "application/merge-patch+json"

_PLURALS = {"PyTorchJob": "pytorchjobs", "JobSet": "jobsets", "Command": "commands", "Job": "jobs",
            "PodGroup": "podgroups", "MPIJob": "mpijobs", "TFJob": "tfjobs"}


def _plural(kind: str) -> str:
    return _PLURALS.get(kind, kind.lower() + "s")


def _quantities_as_text(obj: Any) -> Any:
    """Resource quantities as strings: the API takes ``8`` or ``"8"``, but the client's models refuse a number
    in ``limits``/``requests`` before anything is sent (manifests from templates and policies write numbers)."""
    if isinstance(obj, list):
        return [_quantities_as_text(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    return {k: ({q: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for q, v in v.items()}
                if k in ("limits", "requests", "overhead") and isinstance(v, dict) else _quantities_as_text(v))
            for k, v in obj.items()}


def _split(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


class KubeWorkloads:
    """Workloads port on the Kubernetes API."""

    def __init__(self, api: client.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.timeout = request_timeout_s
        self.pod_watch: Callable[[str], Sequence[PodInfo] | None] | None = None
        """The pods on a node from a watch (the gang scheduler's pod informer), None while it is not in sync."""
        self.pod_lists = 0
        """Pod lists made for ``pods_on_node`` (the watch answered the others)."""

    # -- pods ---------------------------------------------------------------------------------

    def list_pods(self, *, namespace: str | None = None, node: str | None = None,
                  selector: Mapping[str, str] | None = None) -> Sequence[PodInfo]:
        kw: dict[str, Any] = {"_request_timeout": self.timeout}
        if node:
            kw["field_selector"] = f"spec.nodeName={node}"
        if selector:
            kw["label_selector"] = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        if namespace:
            pods = call_api(self.core.list_namespaced_pod, namespace, **kw)
        else:
            pods = call_api(self.core.list_pod_for_all_namespaces, **kw)
        out = [self._info(p) for p in pods.items]
        return [p for p in out if p.phase not in ("Succeeded", "Failed")]

    def pods_on_node(self, node: str) -> Sequence[PodInfo]:
        if self.pod_watch is not None and (watched := self.pod_watch(node)) is not None:
            return watched
        self.pod_lists += 1
        return self.list_pods(node=node)

    def evict_pod(self, namespace: str, name: str, grace_s: int) -> None:
        body = client.V1Eviction(api_version="policy/v1", kind="Eviction",
                                 metadata=client.V1ObjectMeta(name=name, namespace=namespace),
                                 delete_options=client.V1DeleteOptions(grace_period_seconds=grace_s))
        self._gone_ok(self.core.create_namespaced_pod_eviction, name, namespace, body, field_validation=STRICT,
                      _request_timeout=self.timeout)

    def delete_pod(self, namespace: str, name: str, grace_s: int | None = None) -> None:
        kw: dict[str, Any] = {"_request_timeout": self.timeout}
        if grace_s is not None:
            kw["grace_period_seconds"] = grace_s
        self._gone_ok(self.core.delete_namespaced_pod, name, namespace, **kw)

    def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> None:
        create_once(self.core.create_namespaced_pod, namespace, _quantities_as_text(dict(manifest)),
                    field_validation=STRICT, _request_timeout=self.timeout)

    # -- any object -----------------------------------------------------------------------------

    def get_object(self, key: ObjectKey) -> Mapping[str, Any] | None:
        try:
            obj = self._read(key)
        except NotFoundError:
            return None
        out: dict[str, Any] = obj if isinstance(obj, dict) else self._plain(obj)
        return out

    def create_object(self, key: ObjectKey, manifest: Mapping[str, Any]) -> None:
        body = _quantities_as_text({**manifest, "apiVersion": key.api_version, "kind": key.kind})
        t = self.timeout
        if key.kind == "ConfigMap" and key.api_version == "v1":
            create_once(self.core.create_namespaced_config_map, key.namespace, body, field_validation=STRICT,
                        _request_timeout=t)
        elif key.kind == "Pod" and key.api_version == "v1":
            create_once(self.core.create_namespaced_pod, key.namespace, body, field_validation=STRICT,
                        _request_timeout=t)
        elif key.kind == "Job" and key.api_version == "batch/v1":
            create_once(self.batch.create_namespaced_job, key.namespace, body, field_validation=STRICT,
                        _request_timeout=t)
        else:
            group, version = _split(key.api_version)
            create_once(self.custom.create_namespaced_custom_object, group, version, key.namespace,
                        _plural(key.kind), body, field_validation=STRICT, _request_timeout=t)

    def delete_object(self, key: ObjectKey) -> None:
        t = self.timeout
        # Background propagation: the object goes now, its pods after it (each with its grace period).
        opts = client.V1DeleteOptions(propagation_policy="Background")
        if key.kind == "Pod" and key.api_version == "v1":
            self._gone_ok(self.core.delete_namespaced_pod, key.name, key.namespace, _request_timeout=t)
        elif key.kind == "ConfigMap" and key.api_version == "v1":
            self._gone_ok(self.core.delete_namespaced_config_map, key.name, key.namespace, _request_timeout=t)
        elif key.kind == "Job" and key.api_version == "batch/v1":
            self._gone_ok(self.batch.delete_namespaced_job, key.name, key.namespace, body=opts, _request_timeout=t)
        else:
            group, version = _split(key.api_version)
            self._gone_ok(self.custom.delete_namespaced_custom_object, group, version, key.namespace,
                          _plural(key.kind), key.name, body=opts, _request_timeout=t)

    def annotate(self, key: ObjectKey, annotations: Mapping[str, str | None]) -> None:
        body = {"metadata": {"annotations": dict(annotations)}}
        t = self.timeout
        if key.kind == "Pod" and key.api_version == "v1":
            call_api(self.core.patch_namespaced_pod, key.name, key.namespace, body, field_validation=STRICT,
                     _request_timeout=t)
        elif key.kind == "Namespace" and key.api_version == "v1":
            call_api(self.core.patch_namespace, key.name, body, field_validation=STRICT, _request_timeout=t)
        elif key.kind == "Job" and key.api_version == "batch/v1":
            call_api(self.batch.patch_namespaced_job, key.name, key.namespace, body, field_validation=STRICT,
                     _request_timeout=t)
        else:
            group, version = _split(key.api_version)
            call_api(self.custom.patch_namespaced_custom_object, group, version, key.namespace, _plural(key.kind),
                     key.name, body, field_validation=STRICT, _content_type=MERGE_PATCH, _request_timeout=t)

    def apply_config_map(self, namespace: str, name: str, data: Mapping[str, str],
                         labels: Mapping[str, str] | None = None) -> None:
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})}, "data": dict(data)}
        if create_once(self.core.create_namespaced_config_map, namespace, body, field_validation=STRICT,
                       _request_timeout=self.timeout):
            return
        call_api(self.core.patch_namespaced_config_map, name, namespace, {"data": dict(data)},
                 field_validation=STRICT, _request_timeout=self.timeout)

    # -- internals ---------------------------------------------------------------------------------

    def _read(self, key: ObjectKey) -> Any:
        t = self.timeout
        if key.api_version == "v1" and key.kind == "Namespace":
            return call_api(self.core.read_namespace, key.name, _request_timeout=t)
        if key.api_version == "v1" and key.kind == "ConfigMap":
            return call_api(self.core.read_namespaced_config_map, key.name, key.namespace, _request_timeout=t)
        if key.api_version == "v1" and key.kind == "Pod":
            return call_api(self.core.read_namespaced_pod, key.name, key.namespace, _request_timeout=t)
        if key.api_version == "batch/v1" and key.kind == "Job":
            return call_api(self.batch.read_namespaced_job, key.name, key.namespace, _request_timeout=t)
        group, version = _split(key.api_version)
        return call_api(self.custom.get_namespaced_custom_object, group, version, key.namespace, _plural(key.kind),
                     key.name, _request_timeout=t)

    @staticmethod
    def _gone_ok(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Deletes and evictions of an object that is already gone are done, not failed."""
        try:
            fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise translate(exc) from exc
        except OSError as exc:
            raise translate(exc) from exc
        except Exception as exc:
            translated = translate(exc)
            if translated is exc:
                raise
            raise translated from exc

    def _plain(self, obj: Any) -> dict[str, Any]:
        """A typed client object as the JSON the API server sent."""
        out: dict[str, Any] = self.api.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return out

    def _info(self, p: Any) -> PodInfo:
        meta, spec, status = p.metadata, p.spec, p.status
        owners = tuple(OwnerRef(o.api_version, o.kind, o.name, bool(o.controller))
                       for o in (meta.owner_references or []))
        manifest = self._plain(p)
        manifest.pop("status", None)
        created = meta.creation_timestamp.timestamp() if meta.creation_timestamp else 0.0
        return PodInfo(meta.namespace, meta.name, meta.uid or "", (spec.node_name or "") if spec else "",
                       dict(meta.labels or {}), dict(meta.annotations or {}), owners,
                       meta.deletion_timestamp is not None, (status.phase if status else None) or "Pending",
                       created, manifest)
