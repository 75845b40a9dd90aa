"""KubeCluster: the Cluster port on a real API server, through the official client.

Only this package (``healer.kube``) imports ``kubernetes``. Facts it relies
on are in ../shared/KUBERNETES-API.md: cordon is ``spec.unschedulable``; taints
are a whole list, written read-modify-write with ``resourceVersion`` so a
concurrent writer gets 409 instead of being overwritten; node conditions go
through the ``status`` subresource (strategic merge keyed by ``type``).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from healer.cluster import (
    ClusterConfigError,
    ClusterEvent,
    Condition,
    NodeInfo,
    NotFoundError,
    PermanentError,
    Taint,
    TemporaryError,
)
from healer.keys import MANAGED_LABEL
from healer.kube.cache import ListWatchCache
from healer.kube.rest import NODES, Rest, reachability, retry_after, server_down

T = TypeVar("T")
_CONFLICT_RETRIES = 5
CONNECTION_POOL_SIZE = 32
"""Keep-alive connections kept to the API server: the scheduler's bind workers, the healer and the pod watch."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def translate(exc: Exception) -> Exception:
    """Map client errors to the port's error classes (they decide retries)."""
    if isinstance(exc, ApiException):
        status = exc.status or 0
        msg = f"{status} {exc.reason}: {_api_message(exc)}"
        if status == 404:
            return NotFoundError(msg)
        if status in (409, 429) or status >= 500:
            asked = retry_after(exc)
            return TemporaryError(msg, delay=asked or 1.0, unreachable=server_down(exc), retry_after=asked)
        return PermanentError(msg)
    if server_down(exc):
        return TemporaryError(f"{type(exc).__name__}: {exc}", unreachable=True)
    return exc


def _api_message(exc: ApiException) -> str:
    import json

    try:
        body = json.loads(exc.body or "{}")
        return str(body.get("message") or exc.body)
    except (ValueError, TypeError):
        return str(exc.body)


def call_api(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        return fn(*args, **kwargs)
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise translate(exc) from exc


def create_once(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Create an object; 409 AlreadyExists means an earlier try (before a crash or timeout) made it."""
    try:
        fn(*args, **kwargs)
        return True
    except ApiException as exc:
        if exc.status == 409 and "AlreadyExists" in (exc.body or "") + str(exc.reason):
            return False
        raise translate(exc) from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise translate(exc) from exc


STRICT = "Strict"
"""``fieldValidation`` of every write of a built-in object: without it the API server drops a field it does not
know with no more than a warning (the write "succeeds" without it); with it, the write is refused naming the
field (400 on a create, 422 on a patch)."""

#: Where core/v1 Events about cluster-scoped objects (Nodes) must live on a real API server.
CLUSTER_SCOPED_EVENT_NAMESPACE = "default"


class KubeCluster:
    """Cluster port on the Kubernetes API."""

    def __init__(self, api: client.ApiClient, *, event_namespace: str = "default",
                 component: str = "kmend", request_timeout_s: float = 10.0, node_cache: bool = False) -> None:
        self.api = api
        self.node_cache = node_cache
        """``list_nodes`` answers from a watch-fed cache (one list, then a watch) instead of a list per call."""
        self._nodes: ListWatchCache[NodeInfo] | None = None
        self._nodes_lock = threading.Lock()
        # Only for events about namespaced objects; Node events always go to `default` (see emit_event).
        self.event_namespace = event_namespace
        self.component = component
        self.timeout = request_timeout_s
        self.host = socket.gethostname()
        self.reach = reachability(api)
        """Whether the API server answers, as every adapter on this client sees it (the healer backs off on it)."""

    @functools.cached_property
    def core(self) -> client.CoreV1Api:
        """The generated core/v1 API, built on first use: its module alone takes a third of a second to import, and
        `kmend serve` starts the gang scheduler (which does not need it) before anything here is asked."""
        return client.CoreV1Api(self.api)

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, *, in_cluster: bool = False,
                    **kwargs: Any) -> KubeCluster:
        """Build from a kubeconfig file or the in-cluster service account."""
        try:
            if in_cluster:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
                cfg = client.Configuration.get_default_copy()
            else:
                cfg = client.Configuration()
                config.load_kube_config(config_file=kubeconfig,  # type: ignore[no-untyped-call]
                                        client_configuration=cfg)
        except (config.ConfigException, OSError, ValueError) as exc:
            raise ClusterConfigError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) \
                from None
        # The client sizes its pool by the host's CPUs (5 per CPU): a pod limited to one CPU would get 5, fewer than
        # the scheduler's bind workers, and every bind beyond them would open (and handshake) a connection of its own.
        cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, CONNECTION_POOL_SIZE)
        # urllib3 would try a refused connection three more times at once, logging each, and sleep through a 429's
        # Retry-After inside the call: the loops back off instead (``healer.reach``), for as long as the server
        # asks. A read error on a reused connection is still tried once more (idempotent requests only).
        cfg.retries = urllib3.util.Retry(total=1, connect=0, read=1, redirect=0, status=0,
                                         respect_retry_after_header=False)
        return cls(client.ApiClient(cfg), **kwargs)

    def list_nodes(self, labels: Mapping[str, str] | None = None) -> Sequence[NodeInfo]:
        if self.node_cache:
            # The healer's brakes, acceptance and spare pool read the fleet every round: from the watch, not a list.
            wanted = dict(labels or {})
            return [n for n in self._cached_nodes().items()
                    if all(n.labels.get(k) == v for k, v in wanted.items())]
        # Read as plain JSON: the client's model objects cost about a millisecond per node.
        selector = {"label_selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items()))} if labels else {}
        resp: Any = call_api(self.core.list_node, _request_timeout=self.timeout, _preload_content=False, **selector)
        items = json.loads(resp.data).get("items") or []
        return [self._info_json(n) for n in items]

    def _cached_nodes(self) -> ListWatchCache[NodeInfo]:
        with self._nodes_lock:
            if self._nodes is None:
                cache = ListWatchCache("node", Rest(self.api).lister(NODES), self._info_json, timeout_s=self.timeout)
                call_api(cache.start)
                self._nodes = cache
            return self._nodes

    def close(self) -> None:
        """Stop the node watch (a later ``list_nodes`` lists and watches again)."""
        with self._nodes_lock:
            if self._nodes is not None:
                self._nodes.stop()
                self._nodes = None

    def get_node(self, name: str) -> NodeInfo:
        # Raw JSON, as list_nodes: the healer reads the node before most steps, and the client's models cost
        # milliseconds per node.
        resp: Any = call_api(self.core.read_node, name, _request_timeout=self.timeout, _preload_content=False)
        return self._info_json(json.loads(resp.data))

    def peek_node(self, name: str) -> NodeInfo:
        """From the node cache when it has the node (no request), else read as ``get_node``."""
        if self.node_cache:
            seen = self._cached_nodes().get("", name)
            if seen is not None:
                return seen[0]
        return self.get_node(name)

    def cordon(self, name: str) -> None:
        """One PATCH preconditioned on the version of the node the opt-out was checked on.

        The version comes from the node cache when it has one (no read before the write); a node changed since
        (409) is read again, checked again and patched at its new version, so a node opted out a moment ago is
        never cordoned on a stale view of it."""
        seen = self._cached_nodes().get("", name) if self.node_cache else None
        for _ in range(_CONFLICT_RETRIES):
            if seen is None or not seen[1]:
                resp: Any = call_api(self.core.read_node, name, _request_timeout=self.timeout, _preload_content=False)
                obj = json.loads(resp.data)
                seen = self._info_json(obj), (obj.get("metadata") or {}).get("resourceVersion") or ""
            info, version = seen
            if info.labels.get(MANAGED_LABEL) == "false":
                raise PermanentError(f"node {name} has {MANAGED_LABEL}=false: not cordoned")
            body = {"metadata": {"resourceVersion": version}, "spec": {"unschedulable": True}}
            try:
                answer: Any = self.core.patch_node(name, body, field_validation=STRICT,
                                                   _request_timeout=self.timeout, _preload_content=False)
                answer.data  # noqa: B018 - read to the end, unparsed: the connection goes back to the pool
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise translate(exc) from exc
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise translate(exc) from exc
            seen = None  # the node changed since that version: read it and check again
        raise TemporaryError(f"node {name} kept changing")

    def uncordon(self, name: str) -> None:
        call_api(self.core.patch_node, name, {"spec": {"unschedulable": False}}, field_validation=STRICT,
                 _request_timeout=self.timeout)

    def add_taint(self, name: str, taint: Taint) -> None:
        def edit(taints: list[dict[str, Any]]) -> list[dict[str, Any]]:
            kept = [t for t in taints if (t.get("key"), t.get("effect")) != (taint.key, taint.effect)]
            entry: dict[str, Any] = {"key": taint.key, "effect": taint.effect}
            if taint.value:
                entry["value"] = taint.value
            return [*kept, entry]

        self._edit_taints(name, edit)

    def remove_taint(self, name: str, key: str) -> None:
        self._edit_taints(name, lambda taints: [t for t in taints if t.get("key") != key])

    def set_condition(self, name: str, condition: Condition) -> None:
        node = call_api(self.core.read_node_status, name, _request_timeout=self.timeout)
        now = _now()
        transition = now
        for c in (node.status.conditions or []) if node.status else []:
            if c.type == condition.type and c.status == condition.status and c.last_transition_time:
                transition = c.last_transition_time.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"status": {"conditions": [{
            "type": condition.type, "status": condition.status, "reason": condition.reason,
            "message": condition.message, "lastHeartbeatTime": now, "lastTransitionTime": transition,
        }]}}
        call_api(self.core.patch_node_status, name, body, field_validation=STRICT, _request_timeout=self.timeout)

    def emit_event(self, event: ClusterEvent) -> None:
        node: Any = call_api(self.core.read_node, event.node, _request_timeout=self.timeout)
        now = dt.datetime.now(dt.UTC)
        # A Node is cluster-scoped: the API server accepts a core/v1 Event about it only in `default`, with
        # involvedObject.namespace empty (422 anywhere else), whatever event_namespace says.
        namespace = CLUSTER_SCOPED_EVENT_NAMESPACE
        # A keyed event gets a name derived from its key: a retry after a crash meets 409 AlreadyExists.
        meta = (client.V1ObjectMeta(name=f"{event.node}.kmend-{hashlib.sha256(event.key.encode()).hexdigest()[:12]}",
                                    namespace=namespace) if event.key else
                client.V1ObjectMeta(generate_name=f"{event.node}.kmend-", namespace=namespace))
        body = client.CoreV1Event(
            metadata=meta,
            involved_object=client.V1ObjectReference(kind="Node", name=event.node, uid=node.metadata.uid,
                                                     api_version="v1"),
            reason=event.reason, message=event.message[:1024], type=event.type,
            source=client.V1EventSource(component=self.component, host=self.host),
            reporting_component=self.component, reporting_instance=self.host,
            first_timestamp=now, last_timestamp=now, count=1, action="Remediate",
        )
        create_once(self.core.create_namespaced_event, namespace, body, field_validation=STRICT,
                    _request_timeout=self.timeout)

    def patch_node_metadata(self, name: str, *, labels: Mapping[str, str | None] | None = None,
                            annotations: Mapping[str, str | None] | None = None) -> None:
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = dict(labels)
        if annotations:
            meta["annotations"] = dict(annotations)
        if meta:  # a merge patch: null removes a key, other keys are left alone
            call_api(self.core.patch_node, name, {"metadata": meta}, field_validation=STRICT,
                     _request_timeout=self.timeout)

    # -- internals ---------------------------------------------------------------

    def _edit_taints(self, name: str, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
        for attempt in range(_CONFLICT_RETRIES):
            node: Any = call_api(self.core.read_node, name, _request_timeout=self.timeout)
            # API field names (timeAdded), not the client's attribute names (time_added).
            current: list[dict[str, Any]] = [
                self.api.sanitize_for_serialization(t)  # type: ignore[no-untyped-call]
                for t in (node.spec.taints or [])
            ]
            wanted = edit(current)
            if wanted == current:
                return
            body = {"metadata": {"resourceVersion": node.metadata.resource_version},
                    "spec": {"taints": wanted}}
            try:
                call_api(self.core.patch_node, name, body, field_validation=STRICT, _request_timeout=self.timeout)
                return
            except TemporaryError:
                if attempt == _CONFLICT_RETRIES - 1:
                    raise
        raise TemporaryError(f"taints of {name} kept changing")

    @staticmethod
    def _info_json(n: dict[str, Any]) -> NodeInfo:
        meta, spec, status = n.get("metadata") or {}, n.get("spec") or {}, n.get("status") or {}
        taints = tuple(Taint(t.get("key", ""), t.get("value") or "", t.get("effect", ""))
                       for t in spec.get("taints") or [])
        conds = tuple(Condition(c.get("type", ""), c.get("status", ""), c.get("reason") or "", c.get("message") or "")
                      for c in status.get("conditions") or [])
        return NodeInfo(name=meta.get("name", ""), unschedulable=bool(spec.get("unschedulable")), taints=taints,
                        labels=dict(meta.get("labels") or {}), conditions=conds,
                        annotations=dict(meta.get("annotations") or {}))
