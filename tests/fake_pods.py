"""Pod routes of the loopback fake API server: pod lists with field selectors and pages, get, delete (a bound,
unfinished pod only gets ``deletionTimestamp``), ``pods/{name}/binding``, and PodGroups of installed CRDs."""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tests.fake_apiserver_objects import labels_match

if TYPE_CHECKING:
    from tests.fake_apiserver import FakeApiServer


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                  "message": message, "code": code}


_FIELDS = {"spec.schedulerName": lambda p: p["spec"].get("schedulerName", ""),
           "spec.nodeName": lambda p: p["spec"].get("nodeName", ""),
           "status.phase": lambda p: p.get("status", {}).get("phase", ""),
           "metadata.name": lambda p: p["metadata"]["name"],
           "metadata.namespace": lambda p: p["metadata"]["namespace"]}


def _selector(text: str) -> tuple[list[tuple[str, bool, str]], str]:
    """Parse ``a=b,c!=d``; the error names an unsupported field as the API server does."""
    terms: list[tuple[str, bool, str]] = []
    for part in filter(None, text.split(",")):
        negate = "!=" in part
        key, _, value = part.partition("!=" if negate else "=")
        key = key.rstrip("=")
        value = value.lstrip("=")
        if key not in _FIELDS:
            return [], f'field label not supported: {key}'
        terms.append((key, negate, value))
    return terms, ""


def _page(items: list[dict[str, Any]], kind: str, query: dict[str, str],
          version: int = 1) -> tuple[int, dict[str, Any]]:
    start = int(query.get("continue") or 0)
    limit = int(query.get("limit") or 0)
    end = start + limit if limit else len(items)
    meta: dict[str, Any] = {"resourceVersion": str(version)}
    if end < len(items):
        meta["continue"] = str(end)
    return 200, {"kind": kind, "apiVersion": "v1", "metadata": meta,
                 "items": [copy.deepcopy(x) for x in items[start:end]]}


POD_GROUP_FIELDS: dict[tuple[str, str], dict[str, frozenset[str]]] = {
    ("scheduling.x-k8s.io", "v1alpha1"): {
        "spec": frozenset({"minMember", "minResources", "scheduleTimeoutSeconds"}),
        "status": frozenset({"phase", "occupiedBy", "running", "succeeded", "failed", "scheduleStartTime"})},
    ("scheduling.volcano.sh", "v1beta1"): {
        "spec": frozenset({"minMember", "minTaskMember", "queue", "priorityClassName", "minResources",
                           "networkTopology"}),
        "status": frozenset({"phase", "conditions", "running", "succeeded", "failed"})},
}
"""What the PodGroup CRDs' structural schemas declare (scheduler-plugins ``config/crd/bases``, Volcano's): a real
server prunes any other field, or refuses it with ``fieldValidation=Strict``."""


def _undeclared(api: tuple[str, str], body: Any) -> str:
    """The first field of a PodGroup write its CRD does not declare ("" when none)."""
    fields = POD_GROUP_FIELDS.get(api)
    if fields is None or not isinstance(body, dict):
        return ""
    for key, value in sorted(body.items()):
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            return key
        if key in fields and isinstance(value, dict):
            extra = sorted(set(value) - fields[key])
            if extra:
                return f"{key}.{extra[0]}"
    return ""


def _prune(api: tuple[str, str], body: dict[str, Any]) -> None:
    fields = POD_GROUP_FIELDS[api]
    for key in list(body):
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            del body[key]
        elif key in fields and isinstance(body[key], dict):
            body[key] = {k: v for k, v in body[key].items() if k in fields[key]}


def pod_routes(server: FakeApiServer, method: str, path: str, body: Any, ctype: str,
                query: dict[str, str]) -> tuple[int, dict[str, Any]] | None:
    """Pods, bindings and PodGroups; None for paths the node routes serve. Caller holds the lock."""
    if path == "/api/v1/pods" and method == "GET":
        terms, error = _selector(query.get("fieldSelector", ""))
        if error:
            return _status(400, "BadRequest", error)
        items = [p for _, p in sorted(server.pods.items())
                 if all((_FIELDS[k](p) == v) != neg for k, neg, v in terms)]
        return _page(items, "PodList", query, server.watch.version)
    if path == "/api/v1/nodes" and method == "GET":
        selected = [server.nodes[n] for n in sorted(server.nodes)
                    if labels_match(server.nodes[n]["metadata"].get("labels") or {}, query.get("labelSelector", ""))]
        return _page(selected, "NodeList", query, server.node_watch.version)
    m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)(/binding)?", path)
    if m:
        key = (m.group(1), m.group(2))
        pod = server.pods.get(key)
        if pod is None:
            return _status(404, "NotFound", f'pods "{key[1]}" not found')
        if m.group(3) and method == "POST":
            code, out = _bind(pod, body)
            if code == 201:
                server.pod_changed("MODIFIED", pod)
            return code, out
        if not m.group(3) and method == "GET":
            return 200, copy.deepcopy(pod)
        if not m.group(3) and method == "DELETE":
            want = ((body or {}).get("preconditions") or {}).get("uid")
            if want and want != pod["metadata"]["uid"]:
                return _status(409, "Conflict", f'Operation cannot be fulfilled on Pod "{key[1]}": the UID in the '
                                                f"precondition ({want}) does not match the UID in record "
                                                f"({pod['metadata']['uid']}). The object might have been deleted "
                                                "and then recreated")
            if pod["spec"].get("nodeName") and pod["status"].get("phase") not in ("Succeeded", "Failed"):
                # A kubelet must stop it first: the object stays, terminating, with its resources.
                pod["metadata"].setdefault("deletionTimestamp", _now())
                pod["metadata"].setdefault("deletionGracePeriodSeconds", 30)
                server.pod_changed("MODIFIED", pod)
            else:
                del server.pods[key]
                server.pod_changed("DELETED", pod)
            return 200, copy.deepcopy(pod)
        return _status(405, "MethodNotAllowed", f"{method} is not supported on {path}")
    m = re.fullmatch(r"/apis/([^/]+)/([^/]+)(?:/namespaces/([^/]+))?/podgroups(?:/([^/]+))?(/status)?", path)
    if m:
        store = server.custom.get((m.group(1), m.group(2)))
        if store is None:
            return _status(404, "NotFound", f"the server could not find the requested resource {path}")
        if m.group(4) is None and method == "GET":
            items = [g for (ns, _), g in sorted(store.items()) if m.group(3) in (None, ns)]
            return _page(items, "PodGroupList", query, server.watch.version)
        group = store.get((m.group(3) or "", m.group(4) or ""))
        if group is None:
            return _status(404, "NotFound", f'podgroups.{m.group(1)} "{m.group(4)}" not found')
        if method == "PATCH":
            if "merge-patch" not in ctype:
                return _status(415, "UnsupportedMediaType", f"unsupported patch type {ctype}")
            api = (m.group(1), m.group(2))
            if undeclared := _undeclared(api, body):
                if query.get("fieldValidation") == "Strict":
                    return _status(422, "Invalid", f'PodGroup.{m.group(1)} "{m.group(4)}" is invalid: '
                                                   f'.{undeclared}: field not declared in schema')
                server.warnings.append(f"PATCH {path}: unknown field \"{undeclared}\"")
                body = copy.deepcopy(body)
                _prune(api, body)
            part = "status" if m.group(5) else "metadata"
            if part == "status":
                group["status"] = {**group.get("status", {}), **(body or {}).get("status", {})}
            else:
                notes = {**group["metadata"].get("annotations", {}),
                         **((body or {}).get("metadata") or {}).get("annotations", {})}
                group["metadata"]["annotations"] = {k: v for k, v in notes.items() if v is not None}
            server.podgroup_changed(m.group(1), m.group(2), group)
            return 200, copy.deepcopy(group)
        if method == "GET":
            return 200, copy.deepcopy(group)
    return None


def _bind(pod: dict[str, Any], body: Any) -> tuple[int, dict[str, Any]]:
    name = pod["metadata"]["name"]
    target = (body or {}).get("target") or {}
    if not target.get("name"):
        return _status(422, "Invalid", "target.name: Required value")
    want = ((body or {}).get("metadata") or {}).get("uid")
    if want and want != pod["metadata"]["uid"]:
        return _status(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{name}": the UID in the '
                                        f"precondition ({want}) does not match the UID in record "
                                        f"({pod['metadata']['uid']}). The object might have been deleted and "
                                        "then recreated")
    if pod["metadata"].get("deletionTimestamp"):
        return _status(409, "Conflict", f"pod {name} is being deleted, cannot be assigned to a host")
    conflict = f'Operation cannot be fulfilled on pods/binding "{name}": '
    if pod["spec"].get("nodeName"):
        return _status(409, "Conflict", f'{conflict}pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
    if pod["spec"].get("schedulingGates"):  # until every gate is removed, no scheduler may place it
        return _status(409, "Conflict", f"{conflict}pod {name} has non-empty .spec.schedulingGates")
    pod["spec"]["nodeName"] = target["name"]
    return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
