"""Workload routes of the loopback fake API server: what KubeWorkloads uses, as a real API server answers.

Pods: namespaced create (409 AlreadyExists, 422 without containers), list by label and field selectors,
patch (maps merged, ``null`` removes a key), delete with a grace period (a bound, unfinished pod only gets
``deletionTimestamp``; grace 0, an unbound or a finished pod goes at once) and ``pods/{name}/eviction``
(policy/v1): 429 Too Many Requests while a PodDisruptionBudget allows no disruption, never for a pending,
finished or already terminating pod, 500 when two budgets select the pod. Objects: ConfigMaps, batch/v1
Jobs, PodDisruptionBudgets and the custom resources of installed kinds: create (409 AlreadyExists), get,
merge patch, replace guarded by ``resourceVersion`` (409 on stale), delete (404 when gone; owned pods go
with their owner, as the garbage collector does). Volcano Commands are checked against their CRD schema
(``target`` needs apiVersion, kind, name and uid). Namespaces are read-only and exist once named.
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Callable
from typing import Any

Json = dict[str, Any]
Reply = tuple[int, Json]

BUILT_IN = {("", "v1", "configmaps"): "ConfigMap", ("batch", "v1", "jobs"): "Job",
            ("policy", "v1", "poddisruptionbudgets"): "PodDisruptionBudget"}
"""Built-in namespaced kinds served from the object store: (group, version, plural) -> kind."""

_REQUIRED = {"commands": ("target", ("apiVersion", "kind", "name", "uid"))}
"""Required fields of CRD schemas the fake enforces: Volcano's Command target is an OwnerReference."""


def status(code: int, reason: str, message: str) -> Reply:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                  "message": message, "code": code}


def merge_patch(target: Json, patch: Json) -> Json:
    """RFC 7386 merge (what strategic merge does for the maps the adapter patches): ``null`` removes."""
    out = copy.deepcopy(target)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_patch(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def labels_match(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selector ``a=b,c!=d``."""
    for term in filter(None, selector.split(",")):
        negate = "!=" in term
        key, _, value = term.partition("!=" if negate else "=")
        if (labels.get(key.rstrip("=")) == value.lstrip("=")) == negate:
            return False
    return True


class ObjectRoutes:
    """The workload part of the fake; ``server`` supplies ``pods``, ``objects``, ``namespaces``, ``next_rv``."""

    def __init__(self, pods: dict[tuple[str, str], Json], next_rv: Callable[[], str], now: Callable[[], str],
                 on_pod: Callable[[str, Json], None] = lambda kind, pod: None) -> None:
        self.pods = pods
        self.on_pod = on_pod
        """Called with ADDED/MODIFIED/DELETED and the pod, so pod watches see these writes too."""
        self.next_rv = next_rv
        self.now = now
        self.objects: dict[tuple[str, str, str], dict[tuple[str, str], Json]] = {k: {} for k in BUILT_IN}
        self.kinds: dict[tuple[str, str, str], str] = dict(BUILT_IN)
        self.namespaces: dict[str, Json] = {}
        self.service_accounts: set[tuple[str, str]] = set()
        """(namespace, name): only the serviceaccount controller (simulated by tests) creates ``default``."""

    def install(self, group: str, version: str, plural: str, kind: str) -> None:
        self.kinds[(group, version, plural)] = kind
        self.objects.setdefault((group, version, plural), {})

    def meta(self, namespace: str, meta: Json) -> Json:
        self.namespaces.setdefault(namespace, {})
        return {**meta, "namespace": namespace, "uid": str(uuid.uuid4()), "resourceVersion": self.next_rv(),
                "creationTimestamp": self.now(), "generation": 1}

    # -- routing -----------------------------------------------------------------------------

    def route(self, method: str, path: str, body: Any, query: dict[str, str]) -> Reply | None:
        if method == "GET" and path == "/api/v1/pods" and query.get("labelSelector"):
            return self._list_pods(None, query)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path)
        if m:
            if method == "GET":
                return self._list_pods(m.group(1), query)
            if method == "POST":
                return self._create_pod(m.group(1), body or {})
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)(/eviction)?", path)
        if m and (m.group(3) or method in ("PATCH", "DELETE")):
            pod = self.pods.get((m.group(1), m.group(2)))
            if pod is None:
                return status(404, "NotFound", f'pods "{m.group(2)}" not found')
            if m.group(3) and method == "POST":
                return self._evict(pod, body or {})
            if method == "PATCH":
                pod.update(merge_patch(pod, body or {}))
                pod["metadata"]["resourceVersion"] = self.next_rv()
                self.on_pod("MODIFIED", pod)
                return 200, copy.deepcopy(pod)
            if method == "DELETE":
                return self.delete_pod(pod, _grace(body, query), (body or {}).get("preconditions"))
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)", path)
        if m and method == "GET":
            ns = self.namespaces.get(m.group(1))
            if ns is None:
                return status(404, "NotFound", f'namespaces "{m.group(1)}" not found')
            return 200, {"kind": "Namespace", "apiVersion": "v1",
                         "metadata": {"name": m.group(1), **copy.deepcopy(ns)}}
        m = re.fullmatch(r"/api(?:s/([^/]+))?/([^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?", path)
        if m and (m.group(1) or "", m.group(2), m.group(4)) in self.kinds:
            return self._object(method, (m.group(1) or "", m.group(2), m.group(4)), m.group(3), m.group(5), body)
        return None

    # -- pods -------------------------------------------------------------------------------

    def _list_pods(self, namespace: str | None, query: dict[str, str]) -> Reply:
        node = ""
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            key, _, node = term.partition("=")
            if key != "spec.nodeName":
                return status(400, "BadRequest", f"field label not supported: {key}")
        items = [copy.deepcopy(p) for (ns, _), p in sorted(self.pods.items())
                 if namespace in (None, ns) and (not node or p["spec"].get("nodeName") == node)
                 and labels_match(p["metadata"].get("labels") or {}, query.get("labelSelector", ""))]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}

    def _create_pod(self, namespace: str, body: Json) -> Reply:
        name = (body.get("metadata") or {}).get("name", "")
        if (namespace, name) in self.pods:
            return status(409, "AlreadyExists", f'pods "{name}" already exists')
        if not (body.get("spec") or {}).get("containers"):
            return status(422, "Invalid", f'Pod "{name}" is invalid: spec.containers: Required value')
        account = (body.get("spec") or {}).get("serviceAccountName") or "default"
        if (namespace, account) not in self.service_accounts:  # the ServiceAccount admission plugin
            return status(403, "Forbidden", f'pods "{name}" is forbidden: error looking up service account '
                                            f'{namespace}/{account}: serviceaccount "{account}" not found')
        pod = {**copy.deepcopy(body), "kind": "Pod", "apiVersion": "v1", "status": {"phase": "Pending"}}
        pod["metadata"] = self.meta(namespace, pod["metadata"])
        self.pods[(namespace, name)] = pod
        self.on_pod("ADDED", pod)
        return 201, copy.deepcopy(pod)

    def delete_pod(self, pod: Json, grace: int | None, preconditions: Json | None = None) -> Reply:
        meta = pod["metadata"]
        want = (preconditions or {}).get("uid")
        if want and want != meta["uid"]:
            return status(409, "Conflict", f'Operation cannot be fulfilled on Pod "{meta["name"]}": the UID in the '
                                           f"precondition ({want}) does not match the UID in record "
                                           f"({meta['uid']}). The object might have been deleted and then recreated")
        finished = pod.get("status", {}).get("phase") in ("Succeeded", "Failed")
        if not pod["spec"].get("nodeName") or finished or grace == 0:
            if self.pods.pop((meta["namespace"], meta["name"]), None) is not None:
                meta["resourceVersion"] = self.next_rv()  # a delete is a write: watchers see a newer version
                self.on_pod("DELETED", pod)
        elif not meta.get("deletionTimestamp"):
            # A kubelet must stop it first: the object stays, terminating, with its resources.
            meta["deletionTimestamp"] = self.now()
            meta["deletionGracePeriodSeconds"] = 30 if grace is None else grace
            meta["resourceVersion"] = self.next_rv()
            self.on_pod("MODIFIED", pod)
        return 200, copy.deepcopy(pod)

    def _evict(self, pod: Json, body: Json) -> Reply:
        meta = pod["metadata"]
        # A body without apiVersion/kind is read as the endpoint's own kind; another kind is refused.
        if body.get("kind", "Eviction") != "Eviction" or body.get("apiVersion", "policy/v1") != "policy/v1":
            return status(400, "BadRequest", f"expected a policy/v1 Eviction, got {body.get('apiVersion')}"
                                             f"/{body.get('kind')}")
        phase = pod.get("status", {}).get("phase")
        # The API server's canIgnorePDB: pending, finished and terminating pods are not guarded.
        if phase == "Running" and not meta.get("deletionTimestamp"):
            budgets = [b for (ns, _), b in self.objects[("policy", "v1", "poddisruptionbudgets")].items()
                       if ns == meta["namespace"] and _selects(b, pod)]
            if len(budgets) > 1:
                return status(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the "
                                                    "eviction subresource does not support.")
            # The API server reads status.disruptionsAllowed, which only the disruption controller writes:
            # a budget it has not processed yet allows nothing.
            if budgets and int(budgets[0].get("status", {}).get("disruptionsAllowed", 0)) <= 0:
                code, out = status(429, "TooManyRequests",
                                   "Cannot evict pod as it would violate the pod's disruption budget.")
                out["details"] = {"causes": [{"reason": "DisruptionBudget", "message": (
                    f"The disruption budget {budgets[0]['metadata']['name']} needs "
                    f"{budgets[0]['spec'].get('minAvailable')} healthy pods")}]}
                return code, out
            if budgets:  # the eviction itself spends one disruption, as the API server writes to the budget
                budgets[0]["status"]["disruptionsAllowed"] -= 1
        self.delete_pod(pod, (body.get("deleteOptions") or {}).get("gracePeriodSeconds"))
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def run_disruption_controller(self) -> None:
        """What kube-controller-manager's disruption controller does: write each budget's status."""
        for budget in self.objects[("policy", "v1", "poddisruptionbudgets")].values():
            budget.setdefault("status", {})["disruptionsAllowed"] = max(0, self._disruptions_allowed(budget))

    def _disruptions_allowed(self, budget: Json) -> int:
        healthy = [p for (ns, _), p in self.pods.items() if ns == budget["metadata"]["namespace"]
                   and _selects(budget, p) and p.get("status", {}).get("phase") == "Running"
                   and not p["metadata"].get("deletionTimestamp")]
        spec = budget["spec"]
        if "maxUnavailable" in spec:
            expected = sum(1 for (ns, _), p in self.pods.items()
                           if ns == budget["metadata"]["namespace"] and _selects(budget, p))
            return int(spec["maxUnavailable"]) - (expected - len(healthy))
        return len(healthy) - int(spec.get("minAvailable", 0))

    # -- any other object --------------------------------------------------------------------

    def _object(self, method: str, resource: tuple[str, str, str], ns: str, name: str | None, body: Any) -> Reply:
        store, kind = self.objects[resource], self.kinds[resource]
        plural = resource[2]
        if name is None:
            if method == "GET":
                items = [copy.deepcopy(o) for (n, _), o in sorted(store.items()) if n == ns]
                return 200, {"kind": f"{kind}List", "metadata": {"resourceVersion": "1"}, "items": items}
            if method != "POST":
                return status(405, "MethodNotAllowed", method)
            body = body or {}
            name = (body.get("metadata") or {}).get("name", "")
            if not name:
                return status(422, "Invalid", f"{kind}.metadata.name: Required value")
            if (ns, name) in store:
                return status(409, "AlreadyExists", f'{plural} "{name}" already exists')
            if invalid := _schema_error(plural, kind, name, body):
                return status(422, "Invalid", invalid)
            group, version, _ = resource
            obj = {**copy.deepcopy(body), "kind": kind, "apiVersion": f"{group}/{version}" if group else version}
            obj["metadata"] = self.meta(ns, obj["metadata"])
            store[(ns, name)] = obj
            return 201, copy.deepcopy(obj)
        obj = store.get((ns, name))
        if obj is None:
            return status(404, "NotFound", f'{plural} "{name}" not found')
        if method == "GET":
            return 200, copy.deepcopy(obj)
        if method == "DELETE":
            del store[(ns, name)]
            uid = obj["metadata"]["uid"]
            for pod in [p for p in self.pods.values()
                        if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]:
                self.delete_pod(pod, None)  # the garbage collector's part of a background deletion
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}
        if method == "PATCH":
            patched = merge_patch(obj, body or {})
        elif method == "PUT":
            want = ((body or {}).get("metadata") or {}).get("resourceVersion")
            if want and want != obj["metadata"]["resourceVersion"]:
                return status(409, "Conflict", f'Operation cannot be fulfilled on {plural} "{name}": the object '
                                               "has been modified; please apply your changes to the latest "
                                               "version and try again")
            patched = {**copy.deepcopy(body), "metadata": {**obj["metadata"], **body.get("metadata", {})}}
        else:
            return status(405, "MethodNotAllowed", method)
        # Their status has a subresource of its own: a write of the object itself leaves it as it was (v1.36
        # answers 200 and drops the body's status silently).
        patched.pop("status", None)
        if "status" in obj:
            patched["status"] = copy.deepcopy(obj["status"])
        patched["metadata"]["resourceVersion"] = self.next_rv()
        store[(ns, name)] = patched
        return 200, copy.deepcopy(patched)


def _grace(body: Any, query: dict[str, str]) -> int | None:
    if "gracePeriodSeconds" in query:
        return int(query["gracePeriodSeconds"])
    value = (body or {}).get("gracePeriodSeconds")
    return None if value is None else int(value)


def _selects(budget: Json, pod: Json) -> bool:
    want = (budget["spec"].get("selector") or {}).get("matchLabels") or {}
    labels = pod["metadata"].get("labels") or {}
    return bool(want) and all(labels.get(k) == v for k, v in want.items())


def _schema_error(plural: str, kind: str, name: str, body: Json) -> str:
    if plural not in _REQUIRED:
        return ""
    field, required = _REQUIRED[plural]
    value = body.get(field) or {}
    missing = [f for f in required if not value.get(f)]
    return (f'{kind}.{plural} "{name}" is invalid: ' + ", ".join(f"{field}.{f}: Required value" for f in missing)
            if missing else "")


def rbac_verb(method: str, path: str) -> tuple[str, str, str] | None:
    """The (API group, resource[/subresource], verb) an authorizer checks for a request."""
    m = re.fullmatch(r"/api/v1/(.+)|/apis/([^/]+)/[^/]+/(.+)", path)
    if m is None:
        return None
    group, parts = (m.group(2) or ""), (m.group(1) or m.group(3)).split("/")
    if parts[0] == "namespaces" and len(parts) > 2:
        parts = parts[2:]
    resource = parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")
    named = len(parts) > 1
    verb = {"GET": "get" if named else "list", "WATCH": "watch", "POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete" if named else "deletecollection"}.get(method)
    return (group, resource, verb) if verb else None
