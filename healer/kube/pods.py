"""KubePodScheduling: the PodScheduling port over the official ``kubernetes`` client.

Every request goes through ``healer.kube.rest`` with plain dicts: the generated ``CoreV1Api`` takes a third of a
second to import and checks every call with pydantic, and deserialising tens of thousands of pods into client
models costs seconds per cycle; the Binding response is never deserialised at all (the client's V1Binding model
rejects what the API server returns).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import config as kube_config
from kubernetes.client.api_client import ApiClient
from kubernetes.client.exceptions import ApiException

from healer.cluster import ClusterError, NotFoundError, PermanentError, Taint, TemporaryError
from healer.gang.port import (
    ConflictError,
    ObjectRef,
    PodChanges,
    PodGroupPhase,
    PodGroupStatus,
    UncertainError,
)
from healer.gang.quantity import PODS, canonical
from healer.gang.records import (
    NodeRecord,
    PodGroupKind,
    PodGroupRecord,
    PodRecord,
    Requirement,
    SelectorOperator,
    SelectorTerm,
    Snapshot,
    Toleration,
    TolerationOperator,
)
from healer.kube.cache import ListWatchCache
from healer.kube.cluster import STRICT
from healer.kube.rest import MERGE_PATCH, Rest, path, retry_after, server_down
from healer.kube.watch import PodInformer
from healer.workloads import PodInfo

REASON_ANNOTATION = "kmend.io/schedule-reason"
"""PodGroup annotation holding kmend's reason (coscheduling's status schema has no message field)."""
SCHEDULED_ANNOTATION = "kmend.io/scheduled-members"
"""Coscheduling PodGroup annotation holding the members kmend has bound (its status schema has no such count)."""

PODS_PATH = "/api/v1/pods"
"""Pods of every namespace."""
NODES_PATH = "/api/v1/nodes"
"""Nodes."""

_GROUP_APIS = {PodGroupKind.COSCHEDULING: ("scheduling.x-k8s.io", "v1alpha1"),
               PodGroupKind.VOLCANO: ("scheduling.volcano.sh", "v1beta1")}

Json = dict[str, Any]


def map_error(exc: Exception) -> ClusterError:
    """API and transport errors as the port's error classes (kopf-style: the class decides retries)."""
    if isinstance(exc, ApiException):
        message = exc.reason or str(exc)
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(exc.body or "{}").get("message") or message
        status = exc.status or 0
        if status == 404:
            return NotFoundError(message)
        if status == 409:
            return ConflictError(message)
        if status == 429 or status >= 500:
            asked = retry_after(exc)
            return TemporaryError(message, delay=asked or 1.0, unreachable=server_down(exc), retry_after=asked)
        return PermanentError(message)
    if isinstance(exc, urllib3.exceptions.ReadTimeoutError | urllib3.exceptions.ProtocolError):
        # The request reached the server; it may have taken effect.
        return UncertainError(str(exc), unreachable=True)
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return TemporaryError(str(exc), unreachable=True)
    raise exc


def _ts(text: str | None) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text else 0.0


def _add(total: dict[str, int], resources: Mapping[str, Any] | None) -> dict[str, int]:
    for name, qty in (resources or {}).items():
        total[name] = total.get(name, 0) + canonical(name, qty)
    return total


def effective_requests(spec: Json) -> dict[str, int]:
    """What the pod needs on a node, as kube-scheduler counts it.

    Containers and restartable (sidecar) init containers add up; a plain init container runs
    alone, so only its own peak (plus the sidecars started before it) counts; overhead adds on top.
    """
    total: dict[str, int] = {}
    for c in spec.get("containers") or ():
        _add(total, (c.get("resources") or {}).get("requests"))
    sidecars: dict[str, int] = {}
    peak: dict[str, int] = {}
    for c in spec.get("initContainers") or ():
        req = _add({}, (c.get("resources") or {}).get("requests"))
        if c.get("restartPolicy") == "Always":
            for k, v in req.items():
                sidecars[k] = sidecars.get(k, 0) + v
            continue
        for k in set(req) | set(sidecars):
            peak[k] = max(peak.get(k, 0), req.get(k, 0) + sidecars.get(k, 0))
    for k, v in sidecars.items():
        total[k] = total.get(k, 0) + v
    for k, v in peak.items():
        total[k] = max(total.get(k, 0), v)
    _add(total, spec.get("overhead"))
    total[PODS] = 1
    return total


def node_record(obj: Json) -> NodeRecord:
    """A Node object as a NodeRecord."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    taints = tuple(Taint(t.get("key", ""), t.get("value") or "", t.get("effect", ""))
                   for t in spec.get("taints") or ())
    return NodeRecord(meta["name"], _add({}, status.get("allocatable")), dict(meta.get("labels") or {}),
                      taints, bool(spec.get("unschedulable")))


def _requirements(items: Sequence[Json] | None) -> tuple[Requirement, ...]:
    return tuple(Requirement(r["key"], SelectorOperator(r["operator"]), tuple(r.get("values") or ()))
                 for r in items or ())


def pod_record(obj: Json) -> PodRecord:
    """A Pod object as a PodRecord.

    A pod with ``spec.schedulingGates`` (held back by a queue such as Kueue) is not to be placed yet: the API
    server refuses its binding (409 ``non-empty .spec.schedulingGates``) and kube-scheduler leaves it alone, so
    it is read as holding nothing and needing no place (``finished``) until its last gate is removed.
    """
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    required = ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution")) or {})
    terms = tuple(SelectorTerm(_requirements(t.get("matchExpressions")), _requirements(t.get("matchFields")))
                  for t in required.get("nodeSelectorTerms") or ())
    tolerations = tuple(Toleration(t.get("key") or "", TolerationOperator(t.get("operator") or "Equal"),
                                   t.get("value") or "", t.get("effect") or "")
                        for t in spec.get("tolerations") or ())
    return PodRecord(
        namespace=meta.get("namespace", ""), name=meta["name"], uid=meta.get("uid", ""),
        requests=effective_requests(spec), node_name=spec.get("nodeName") or "",
        scheduler_name=spec.get("schedulerName") or "default-scheduler",
        terminating=meta.get("deletionTimestamp") is not None,
        finished=status.get("phase") in ("Succeeded", "Failed") or bool(spec.get("schedulingGates")
                                                                       and not spec.get("nodeName")),
        labels=dict(meta.get("labels") or {}), annotations=dict(meta.get("annotations") or {}),
        tolerations=tolerations, node_selector=dict(spec.get("nodeSelector") or {}), affinity=terms,
        priority=int(spec.get("priority") or 0), created=_ts(meta.get("creationTimestamp")))


def pod_group_record(obj: Json, kind: PodGroupKind) -> PodGroupRecord:
    """A PodGroup object (either API) as a PodGroupRecord."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    timeout = spec.get("scheduleTimeoutSeconds")
    return PodGroupRecord(
        namespace=meta.get("namespace", ""), name=meta["name"], min_member=int(spec.get("minMember") or 1),
        min_resources=_add({}, spec.get("minResources")),
        schedule_timeout_seconds=float(timeout) if timeout is not None else None,
        created=_ts(meta.get("creationTimestamp")), uid=meta.get("uid", ""),
        annotations=dict(meta.get("annotations") or {}), kind=kind)


def _group_record(obj: Json, *, kind: PodGroupKind) -> PodGroupRecord:
    return pod_group_record(obj, kind)


class KubePodScheduling:
    """PodScheduling against a real API server; see the Protocol for the guarantees."""

    def __init__(self, api: ApiClient, *, clock: Callable[[], float], component: str = "kmend",
                 page_size: int = 1000, timeout_s: float = 30.0, watch_read_timeout_s: float = 10.0,
                 watch_timeout_s: int = 300) -> None:
        self.rest = Rest(api)
        self.clock = clock
        self.component = component
        self.page_size = page_size
        self.timeout_s = timeout_s
        self._watch_options: dict[str, Any] = {"read_timeout_s": watch_read_timeout_s,
                                               "watch_timeout_s": watch_timeout_s}
        self._informer: PodInformer | None = None
        self._nodes: ListWatchCache[NodeRecord] | None = None
        self._groups: list[ListWatchCache[PodGroupRecord]] = []
        self.on_change: Callable[[PodRecord], None] | None = None
        self.on_groups_change: Callable[[], None] | None = None
        """Called when a PodGroup arrives or changes (its watch): a gang whose pods came first can be placed now."""
        """Told of each pod the watch sees added or changed (the scheduler wakes on a pending pod of its own)."""
        self._cursor = ""
        self._reads = 0

    @classmethod
    def from_kubeconfig(cls, path: str, *, clock: Callable[[], float], **kw: Any) -> KubePodScheduling:
        """An adapter for the cluster a kubeconfig file names."""
        load: Callable[..., ApiClient] = kube_config.new_client_from_config
        return cls(load(config_file=path), clock=clock, **kw)

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise map_error(exc) from exc

    def _write(self, method: str, url_path: str, body: Json | None, *, content_type: str | None = None,
               strict: bool = True) -> None:
        """A write whose answer kmend does not need, read to the end so that the connection goes back to the pool
        (an unread response keeps it, and the next request pays a new connection: a TLS handshake on a real
        server). ``strict``: the server refuses a field it does not know instead of dropping it."""
        query = {"fieldValidation": STRICT} if strict else None
        self._call(self.rest.call, method, url_path, query=query, body=body, content_type=content_type,
                   timeout=self.timeout_s)

    def _pages(self, fn: Callable[..., Any], **kw: Any) -> Iterator[Json]:
        token: str | None = None
        while True:
            resp = self._call(fn, limit=self.page_size, _continue=token, _request_timeout=self.timeout_s, **kw)
            body = json.loads(resp.data)
            yield from body.get("items") or ()
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return

    def list_pending(self, scheduler_name: str) -> Sequence[PodRecord]:
        """Pods for ``scheduler_name`` with no node, not terminating and not finished."""
        selector = f"spec.schedulerName={scheduler_name},spec.nodeName="
        pods = (pod_record(o) for o in self._pages(self.rest.lister(PODS_PATH), field_selector=selector))
        return [p for p in pods if not p.terminating and not p.finished]

    def snapshot(self) -> Snapshot:
        """Nodes, pods that are not finished, and PodGroups of both APIs (an absent CRD gives none)."""
        nodes = tuple(node_record(o) for o in self._pages(self.rest.lister(NODES_PATH)))
        running = "status.phase!=Succeeded,status.phase!=Failed"
        pods = tuple(pod_record(o) for o in self._pages(self.rest.lister(PODS_PATH), field_selector=running))
        return Snapshot(nodes, pods, self._pod_groups())

    def _pod_groups(self) -> tuple[PodGroupRecord, ...]:
        groups: list[PodGroupRecord] = []
        for kind, (group, version) in _GROUP_APIS.items():
            try:
                body = json.loads(self._call(self.rest.call, "GET", path("apis", group, version, "podgroups"),
                                             timeout=self.timeout_s))
            except NotFoundError:
                continue
            groups.extend(pod_group_record(o, kind) for o in body.get("items") or ())
        return tuple(groups)

    def _cache(self, name: str, list_fn: Callable[..., Any], convert: Callable[[Json], Any],
               args: tuple[Any, ...] = (), on_change: Callable[[], None] | None = None) -> ListWatchCache[Any]:
        cache: ListWatchCache[Any] = ListWatchCache(
            name, list_fn, convert, args=args, page_size=self.page_size, timeout_s=self.timeout_s,
            on_change=on_change, **self._watch_options)
        try:
            cache.start()
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise map_error(exc) from exc
        return cache

    def changes(self, cursor: str) -> PodChanges:
        """Pods from the informer's change log, nodes and PodGroups from their watch-fed caches.

        The first call lists every pod, node and PodGroup (of both APIs; a CRD not installed reads as none
        until it is) and starts the watches. A cursor other than the one the
        previous call returned, or a watch that had to list again, gives a full list. Changes
        reach the log as the watch delivers them, as with any informer: a write made a moment
        ago may show in the next call rather than this one.
        """
        if self._informer is None:
            informer = PodInformer(self.rest.lister(PODS_PATH), pod_record, page_size=self.page_size,
                                   timeout_s=self.timeout_s, on_change=self._changed, **self._watch_options)
            try:
                informer.start()
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                raise map_error(exc) from exc
            self._informer = informer
        if self._nodes is None:
            self._nodes = self._cache("node", self.rest.lister(NODES_PATH), node_record)
        if not self._groups:
            for kind, (group, version) in _GROUP_APIS.items():
                self._groups.append(self._cache(f"podgroup.{group}",
                                                self.rest.lister(path("apis", group, version, "podgroups")),
                                                functools.partial(_group_record, kind=kind),
                                                on_change=self._groups_changed))
        drained = self._informer.drain(everything=cursor != self._cursor)
        self._reads += 1
        self._cursor = f"{id(self._informer):x}.{self._reads}"
        snap_nodes = tuple(sorted(self._nodes.items(), key=lambda n: n.name))
        groups = tuple(sorted((g for cache in self._groups for g in cache.items()),
                              key=lambda g: (g.kind, g.namespace, g.name)))
        return PodChanges(self._cursor, drained.full, drained.pods, drained.gone, snap_nodes, groups)

    def pods_on_node(self, node: str) -> list[PodInfo] | None:
        """The unfinished pods bound to ``node`` as the pod watch shows them; None until it runs and while it is
        not in sync (the caller lists instead)."""
        informer = self._informer
        return None if informer is None else informer.on_node(node)

    def _groups_changed(self) -> None:
        if self.on_groups_change is not None:
            self.on_groups_change()

    def _changed(self, pod: PodRecord) -> None:
        if self.on_change is not None:
            self.on_change(pod)

    def close(self) -> None:
        """Stop the pod, node and PodGroup watches (a later ``changes`` lists and watches again)."""
        if self._informer is not None:
            self._informer.stop()
            self._informer = None
        if self._nodes is not None:
            self._nodes.stop()
            self._nodes = None
        for cache in self._groups:
            cache.stop()
        self._groups = []

    def bind(self, pod: PodRecord, node: str) -> None:
        """POST pods/{name}/binding with the pod's UID as precondition."""
        meta: Json = {"name": pod.name, **({"uid": pod.uid} if pod.uid else {})}
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        self._write("POST", path("api", "v1", "namespaces", pod.namespace, "pods", pod.name, "binding"), body)

    def delete_pod(self, pod: PodRecord) -> None:
        """DELETE with a UID precondition: a missing or already recreated pod counts as released."""
        options = ({"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": pod.uid}}
                   if pod.uid else None)
        try:
            self._write("DELETE", path("api", "v1", "namespaces", pod.namespace, "pods", pod.name), options,
                        strict=False)
        except (NotFoundError, ConflictError):
            return

    def emit_event(self, ref: ObjectRef, reason: str, message: str, type: str = "Normal") -> None:
        """A core/v1 Event about ``ref``, from this component."""
        now = datetime.fromtimestamp(self.clock(), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        involved: Json = {"kind": ref.kind, "namespace": ref.namespace, "name": ref.name,
                          "apiVersion": ref.api_version, **({"uid": ref.uid} if ref.uid else {})}
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": f"{ref.name}.{int(self.clock() * 1e9):x}", "namespace": ref.namespace},
                 "involvedObject": involved, "reason": reason, "message": message[:1024], "type": type, "count": 1,
                 "firstTimestamp": now, "lastTimestamp": now, "source": {"component": self.component},
                 "reportingComponent": self.component}
        try:
            self._write("POST", path("api", "v1", "namespaces", ref.namespace, "events"), event)
        except NotFoundError:
            return

    def set_pod_group_status(self, namespace: str, name: str, kind: PodGroupKind,
                             status: PodGroupStatus) -> None:
        """Phase and scheduled count through the status subresource; the reason as an annotation."""
        group, version = _GROUP_APIS[kind]
        if kind == PodGroupKind.VOLCANO:
            phase = "Running" if status.phase == PodGroupPhase.SCHEDULED else "Pending"
            body: Json = {"status": {"phase": phase, "running": status.scheduled}}
        else:
            # The coscheduling CRD declares no count of bound members (only running, succeeded, failed, which its
            # controller keeps from the pods' phases): the count goes with the reason, as an annotation.
            body = {"status": {"phase": str(status.phase)}}
        annotations = {REASON_ANNOTATION: status.reason or None}
        if kind == PodGroupKind.COSCHEDULING:
            annotations[SCHEDULED_ANNOTATION] = str(status.scheduled)
        try:
            # Strict: a field the CRD does not declare is refused, not silently pruned.
            where = path("apis", group, version, "namespaces", namespace, "podgroups", name)
            self._write("PATCH", where + "/status", body, content_type=MERGE_PATCH)
            self._write("PATCH", where, {"metadata": {"annotations": annotations}}, content_type=MERGE_PATCH)
        except NotFoundError:
            return
