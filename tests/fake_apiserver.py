"""A small Kubernetes API server on loopback, for running KubeCluster through the real client.

It implements just what the Cluster and PodScheduling ports use, with the behaviour of
../shared/KUBERNETES-API.md: strategic-merge patches on nodes (taints replaced
whole, a stale ``metadata.resourceVersion`` gets 409), node conditions only
through ``/status`` (merged by type; a plain patch ignores ``status``), events
with ``generateName`` (422 for one about a Node outside ``default``); pods listed
with field selectors and ``limit``/``continue``
pages, bound through ``pods/{name}/binding`` (409 when bound, terminating or
the UID precondition fails), deleted by setting ``deletionTimestamp`` while
bound; pod, node and PodGroup lists carry the current ``resourceVersion`` and ``watch=true`` streams
their changes from it (``tests/fake_watch.py``); PodGroup custom objects once their CRD is installed
(lists and watches of an uninstalled one answer 404). Errors can be queued per method and path to test retries. What
the Workloads port uses (pod create/patch/eviction, ConfigMaps, Jobs, budgets,
other custom objects) is in ``tests/fake_apiserver_objects.py``, pods and bindings in ``tests/fake_pods.py``,
RBAC in ``tests/fake_rbac.py``. Every write is field-validated against the v1.36 schema by its
``fieldValidation`` mode (``tests/fake_schema.py``) and checked as the API server's own validation checks it
(``tests/fake_rules.py``). Every request is recorded (``requests``) so tests can derive the RBAC verbs a
component needs.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs

from tests import fake_rules, fake_schema
from tests.fake_apiserver_objects import ObjectRoutes, rbac_verb
from tests.fake_pods import pod_routes
from tests.fake_rbac import RoleRules
from tests.fake_serving import Server, StartupWindow
from tests.fake_watch import PodWatchLog


class FakeApiServer:
    """Serve on 127.0.0.1:<free port>; `url` is the base URL for a kubeconfig/Configuration."""

    def __init__(self, *, rbac: RoleRules | None = None, startup_s: float = 0.0, startup_requests: int = 0,
                 role: str = "kmend") -> None:
        self.rbac = rbac
        self.startup = StartupWindow(startup_s, rbac, role, at_least=startup_requests)  # a real server's first moments
        """When set, clients authenticate with its token and may only do what its rules grant (403 otherwise),
        as a real API server does for a ServiceAccount bound to a ClusterRole."""
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.custom: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        self.bodies: list[tuple[str, str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self.warnings: list[str] = []
        """Field-validation warnings answered (unknown fields written without ``fieldValidation=Strict``)."""
        self.lax_writes: list[str] = []
        """Writes of built-in objects and custom resources sent without ``fieldValidation=Strict`` (a real server
        drops unknown fields from them with no more than a warning)."""
        self._errors: deque[tuple[str, re.Pattern[str], int, str]] = deque()
        self._lock = threading.Lock()
        self.watch = PodWatchLog(self._lock)
        """Pod watch history and stream controls (``end_streams``, ``expire``)."""
        self.node_watch = PodWatchLog(self._lock, kind="Node")
        """Node watch history and stream controls, as for pods."""
        self.podgroup_watch: dict[tuple[str, str], PodWatchLog] = {}
        """PodGroup watch history and stream controls per installed ``(group, version)``, as for pods."""
        self._rv = self._versions()
        self.workload = ObjectRoutes(self.pods, lambda: str(next(self._rv)), _now, self.watch.record)
        server = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive with replies sent at once, as a real API server answers: a client that reuses its
            # connections pays no connect per request, and one that does not is seen to pay it.
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                return None

            def _send(self, code: int, body: dict[str, Any], warning: str | None = None,
                      headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(key, value)
                if warning is not None:
                    escaped = warning.replace('"', '\\"')
                    self.send_header("Warning", f'299 - "{escaped}"')  # as the API server quotes it
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _send_text(self, code: int, text: str) -> None:
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null")
                path, _, qs = self.path.partition("?")
                query = {k: v[-1] for k, v in parse_qs(qs, keep_blank_values=True).items()}
                watching = method == "GET" and query.get("watch") in ("true", "1")
                # Only what clients send, not the test controls; a watch is its own verb for RBAC.
                server.requests.append(("WATCH" if watching else method, path))
                if (early := server.startup.refusal("WATCH" if watching else method, path)) is not None:
                    self._send(*early)
                    return
                if server.rbac is not None:
                    refused = server.rbac.refuse(self.headers.get("Authorization"), "WATCH" if watching else method,
                                                 path)
                    if refused is not None:
                        self._send(*refused)
                        return
                if watching and path == "/api/v1/pods":
                    server.watch.serve(self, query)
                    return
                if watching and path == "/api/v1/nodes":
                    server.node_watch.serve(self, query)
                    return
                crd = re.match(r"/apis/([^/]+)/([^/]+)/(?:namespaces/[^/]+/)?podgroups(?:/|$)", path)
                if crd is not None and (crd.group(1), crd.group(2)) not in server.podgroup_watch:
                    # An API group no CRD serves is unknown to the server's router: a plain-text 404, not a Status.
                    self._send_text(404, "404 page not found\n")
                    return
                if crd is not None and watching:
                    server.podgroup_watch[(crd.group(1), crd.group(2))].serve(self, query)
                    return
                ctype = self.headers.get("Content-Type", "")
                refused, warning = fake_schema.field_check(method, path, body, ctype, query)
                refused = refused or fake_rules.refusal(method, path, body, ctype)
                if refused is not None:
                    self._send(*refused)
                    return
                if warning is not None:
                    server.warnings.append(f"{method} {path}: {warning}")
                if query.get("fieldValidation") != "Strict" and (fake_schema.checked_write(method, path, ctype)
                                                                or fake_schema.custom_write(method, path)):
                    server.lax_writes.append(f"{method} {path}")
                code, out = server.handle(method, path, body, ctype, query)
                self._send(code, out, warning)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

            def do_PUT(self) -> None:
                self._handle("PUT")

        self._handler = Handler
        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeApiServer:
        self.httpd.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.stop()

    def down(self) -> None:
        """The server stops as a killed one does: port closed, open connections and watches reset; objects kept."""
        self.httpd.stop()

    def up(self, *, startup_s: float | None = None) -> None:
        """Start again on the same port with the same objects, through the start-up window again (``startup_s``)."""
        self.startup = self.startup.again(startup_s)
        self.httpd = Server(("127.0.0.1", self.port), self._handler)
        self.httpd.start()

    def _versions(self) -> Iterator[int]:
        for n in itertools.count(100):
            self.watch.version = self.node_watch.version = n
            for group_watch in self.podgroup_watch.values():
                group_watch.version = n
            yield n

    def pod_changed(self, kind: str, pod: dict[str, Any]) -> None:
        """A write to a pod: new resourceVersion, and the event for watchers. Caller holds the lock."""
        pod["metadata"]["resourceVersion"] = str(next(self._rv))
        self.watch.record(kind, pod)

    # -- test controls -------------------------------------------------------------

    def fail(self, method: str, path_regex: str, status: int, message: str = "injected") -> None:
        """Answer the next matching request with this status."""
        self._errors.append((method, re.compile(path_regex), status, message))

    def add_pod(self, namespace: str, name: str, *, scheduler: str = "default-scheduler", node: str = "",
                requests: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                phase: str = "Pending", owners: list[dict[str, Any]] | None = None,
                gates: list[str] | None = None) -> dict[str, Any]:
        """Create a pod directly (as a controller would; a kubelet sets ``phase``) and return the stored object.

        ``gates`` are its ``spec.schedulingGates`` (a queue such as Kueue holds pods back with one)."""
        with self._lock:
            pod = {"kind": "Pod", "apiVersion": "v1",
                   "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                                "labels": labels or {}, "resourceVersion": str(next(self._rv)),
                                "creationTimestamp": _now(), "ownerReferences": owners or []},
                   "spec": {"schedulerName": scheduler,
                            "containers": [{"name": "c", "image": "busybox",
                                            "resources": {"requests": requests or {}}}]},
                   "status": {"phase": phase}}
            if node:
                pod["spec"]["nodeName"] = node
            if gates:
                pod["spec"]["schedulingGates"] = [{"name": g} for g in gates]
            self.pods[(namespace, name)] = pod
            self.watch.record("ADDED", pod)
            self.workload.namespaces.setdefault(namespace, {})
            return copy.deepcopy(pod)

    def set_phase(self, namespace: str, name: str, phase: str) -> None:
        """The kubelet reports a pod's phase (``Succeeded``/``Failed`` finish it)."""
        with self._lock:
            pod = self.pods[(namespace, name)]
            pod["status"]["phase"] = phase
            self.pod_changed("MODIFIED", pod)

    def install_kind(self, group: str, version: str, plural: str, kind: str) -> None:
        """Serve a custom resource's CRD (PyTorchJob, JobSet, Volcano Job and Command)."""
        with self._lock:
            self.workload.install(group, version, plural, kind)

    def add_object(self, group: str, version: str, plural: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object of an installed or built-in kind directly and return the stored object."""
        path = (f"/apis/{group}/{version}" if group else f"/api/{version}") + f"/namespaces/{namespace}/{plural}"
        with self._lock:
            code, out = self.workload.route("POST", path, body, {}) or (404, {})
        assert code == 201, out
        return out

    def object(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object, or None."""
        with self._lock:
            return copy.deepcopy(self.workload.objects[(group, version, plural)].get((namespace, name)))

    def set_status(self, group: str, version: str, plural: str, namespace: str, name: str,
                   status: dict[str, Any]) -> None:
        """A controller writes an object's status (a Job's ``succeeded``)."""
        with self._lock:
            self.workload.objects[(group, version, plural)][(namespace, name)]["status"] = status

    def verbs(self) -> set[tuple[str, str, str]]:
        """(API group, resource, verb) of every request served so far, for checking RBAC rules."""
        return {v for method, path in self.requests if (v := rbac_verb(method, path)) is not None}

    def finish_termination(self, namespace: str, name: str) -> None:
        """The kubelet finished a terminating pod: the object goes."""
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is not None and pod["metadata"].get("deletionTimestamp"):
                del self.pods[(namespace, name)]
                self.pod_changed("DELETED", pod)

    def add_service_account(self, namespace: str, name: str = "default") -> None:
        """What the serviceaccount controller does shortly after a namespace appears; pods need it to be admitted."""
        with self._lock:
            self.workload.namespaces.setdefault(namespace, {})
            self.workload.service_accounts.add((namespace, name))

    def run_disruption_controller(self) -> None:
        """A bare API server runs no controllers: tests call this where the disruption controller would run."""
        with self._lock:
            self.workload.run_disruption_controller()

    def install_crd(self, group: str, version: str) -> None:
        """Serve ``podgroups`` of ``group/version`` (an uninstalled CRD answers 404, to lists and watches)."""
        with self._lock:
            self.custom.setdefault((group, version), {})
            if (group, version) not in self.podgroup_watch:
                group_watch = PodWatchLog(self._lock, kind="PodGroup", api_version=f"{group}/{version}")
                group_watch.version = self.watch.version
                self.podgroup_watch[(group, version)] = group_watch

    def add_custom(self, group: str, version: str, namespace: str, name: str, spec: dict[str, Any]) -> None:
        """Create a PodGroup of an installed CRD (as a training operator would)."""
        with self._lock:
            group_obj = {
                "apiVersion": f"{group}/{version}", "kind": "PodGroup",
                "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()), "annotations": {},
                             "creationTimestamp": _now(), "resourceVersion": str(next(self._rv))},
                "spec": spec}
            self.custom[(group, version)][(namespace, name)] = group_obj
            self.podgroup_watch[(group, version)].record("ADDED", group_obj)

    def remove_custom(self, group: str, version: str, namespace: str, name: str) -> None:
        """Delete a PodGroup (its job was deleted)."""
        with self._lock:
            group_obj = self.custom[(group, version)].pop((namespace, name))
            group_obj["metadata"]["resourceVersion"] = str(next(self._rv))
            self.podgroup_watch[(group, version)].record("DELETED", group_obj)

    def podgroup_changed(self, group: str, version: str, group_obj: dict[str, Any]) -> None:
        """A write to a PodGroup: new resourceVersion, and the event for watchers. Caller holds the lock."""
        group_obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.podgroup_watch[(group, version)].record("MODIFIED", group_obj)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        """Create a Ready node directly (as if a kubelet had registered it)."""
        self.handle("POST", "/api/v1/nodes", {"metadata": {"name": name, "labels": labels or {}}}, "")
        with self._lock:
            node = self.nodes[name]
            node["status"]["conditions"] = [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]
            node["spec"]["taints"] = []
            self.node_changed("MODIFIED", node)

    def node_changed(self, kind: str, node: dict[str, Any]) -> None:
        """A node was changed outside the API (a kubelet, a test): new resourceVersion, and the event for watchers.
        Caller holds the lock."""
        node["metadata"]["resourceVersion"] = str(next(self._rv))
        self.node_watch.record(kind, node)

    # -- the API -------------------------------------------------------------------

    @staticmethod
    def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                      "message": message, "code": code}

    def handle(self, method: str, path: str, body: Any, ctype: str,
               query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.bodies.append((method, path, body))
            for i, (m, rx, code, msg) in enumerate(self._errors):
                if m == method and rx.search(path):
                    del self._errors[i]
                    return self._status(code, "Injected", msg)
            workload = self.workload.route(method, path, body, query or {})
            if workload is not None:
                return workload
            pods = pod_routes(self, method, path, body, ctype, query or {})
            if pods is not None:
                return pods
            return self._route(method, path, body, ctype)

    def _route(self, method: str, path: str, body: Any, ctype: str) -> tuple[int, dict[str, Any]]:
        if path == "/api/v1/nodes":
            if method == "GET":
                return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                             "items": [copy.deepcopy(n) for n in self.nodes.values()]}
            if method == "POST":
                name = body["metadata"]["name"]
                if name in self.nodes:
                    return self._status(409, "AlreadyExists", f'nodes "{name}" already exists')
                node = {"kind": "Node", "apiVersion": "v1",
                        "metadata": {"name": name, "uid": str(uuid.uuid4()),
                                     "labels": body["metadata"].get("labels", {}),
                                     "resourceVersion": str(next(self._rv))},
                        "spec": {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]},
                        "status": {"conditions": []}}
                self.nodes[name] = node
                self.node_watch.record("ADDED", node)
                return 201, copy.deepcopy(node)
        m = re.fullmatch(r"/api/v1/nodes/([^/]+)(/status)?", path)
        if m:
            name, status = m.group(1), bool(m.group(2))
            node = self.nodes.get(name)
            if node is None:
                return self._status(404, "NotFound", f'nodes "{name}" not found')
            if method == "GET":
                return 200, copy.deepcopy(node)
            if method == "DELETE":
                self.node_watch.record("DELETED", self.nodes.pop(name))
                return 200, {"kind": "Status", "status": "Success"}
            if method == "PATCH":
                if "strategic-merge-patch" not in ctype and "merge-patch" not in ctype:
                    return self._status(415, "UnsupportedMediaType", f"unsupported patch type {ctype}")
                return self._patch_node(node, body, status)
        m = re.fullmatch(r"/apis/coordination.k8s.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?", path)
        if m:
            return self._lease(method, m.group(1), m.group(2), body)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path)
        if m and method == "POST":
            ev = copy.deepcopy(body)
            meta = ev.setdefault("metadata", {})
            meta["name"] = meta.get("name") or meta.pop("generateName", "event-") + uuid.uuid4().hex[:5]
            meta["namespace"] = m.group(1)
            if any(e["metadata"]["name"] == meta["name"] for e in self.events):
                return self._status(409, "AlreadyExists", f'events "{meta["name"]}" already exists')
            involved = ev.get("involvedObject", {})
            if not involved.get("name"):
                return self._status(422, "Invalid", "involvedObject.name: Required value")
            if refusal := _event_namespace_refusal(ev):
                return self._status(422, "Invalid", refusal)
            self.events.append(ev)
            return 201, ev
        return self._status(404, "NotFound", f"the server could not find the requested resource {path}")

    def _lease(self, method: str, ns: str, name: str | None, body: Any) -> tuple[int, dict[str, Any]]:
        """Leases: create (409 if it exists), get, replace guarded by metadata.resourceVersion (409 if stale, 422
        if missing; 400 for a body naming another lease).

        ``acquireTime`` and ``renewTime`` are MicroTime: the API server parses them as RFC 3339 with exactly
        six fractional digits and answers 400 to anything else."""
        for field in ("acquireTime", "renewTime"):
            value = ((body or {}).get("spec") or {}).get(field)
            if value is not None and not _MICRO_TIME.fullmatch(value):
                return self._status(400, "BadRequest", f'parsing time "{value}" as "2006-01-02T15:04:05.000000Z07:00"'
                                    f': cannot parse as ".000000" (spec.{field})')
        if method == "POST" and name is None:
            name = body["metadata"]["name"]
            if (ns, name) in self.leases:
                return self._status(409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists')
            lease = {**copy.deepcopy(body), "kind": "Lease", "apiVersion": "coordination.k8s.io/v1"}
            lease["metadata"].update(namespace=ns, resourceVersion=str(next(self._rv)))
            self.leases[(ns, name)] = lease
            return 201, copy.deepcopy(lease)
        if method == "PUT" and (body.get("metadata") or {}).get("name") != name:  # before the lookup, as v1.24 does
            return self._status(400, "BadRequest", f"the name of the object ({body['metadata'].get('name')}) does "
                                                   f"not match the name on the URL ({name})")
        current = self.leases.get((ns, name or ""))
        if current is None:
            return self._status(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
        if method == "GET":
            return 200, copy.deepcopy(current)
        if method == "PUT":
            if not body["metadata"].get("resourceVersion"):  # an update is never unconditional: 422, not a conflict
                return self._status(422, "Invalid", f'leases.coordination.k8s.io "{name}" is invalid: '
                                                    "metadata.resourceVersion: Invalid value: 0: must be specified "
                                                    "for an update")
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return self._status(409, "Conflict", f'Operation cannot be fulfilled on leases.coordination.k8s.io '
                                    f'"{name}": the object has been modified')
            lease = {**copy.deepcopy(body), "kind": "Lease", "apiVersion": "coordination.k8s.io/v1"}
            lease["metadata"].update(namespace=ns, resourceVersion=str(next(self._rv)))
            self.leases[(ns, name or "")] = lease
            return 200, copy.deepcopy(lease)
        return self._status(405, "MethodNotAllowed", method)

    def _patch_node(self, node: dict[str, Any], body: dict[str, Any], status: bool) -> tuple[int, dict[str, Any]]:
        want_rv = body.get("metadata", {}).get("resourceVersion")
        if want_rv is not None and want_rv != node["metadata"]["resourceVersion"]:
            name = node["metadata"]["name"]
            return self._status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the object has '
                                "been modified; please apply your changes to the latest version and try again")
        if status:
            conds = {c["type"]: c for c in node["status"].get("conditions", [])}
            for c in body.get("status", {}).get("conditions", []):
                conds[c["type"]] = {**conds.get(c["type"], {}), **c}
            node["status"]["conditions"] = list(conds.values())
            if conds.get("Ready", {}).get("status") == "True":
                node["spec"]["taints"] = [t for t in node["spec"].get("taints", [])
                                          if t["key"] != "node.kubernetes.io/not-ready"]
        else:
            spec = body.get("spec", {})
            if "unschedulable" in spec:
                node["spec"]["unschedulable"] = bool(spec["unschedulable"])
            if "taints" in spec:
                node["spec"]["taints"] = spec["taints"]
            for key in ("labels", "annotations"):
                if key in body.get("metadata", {}):
                    merged = {**node["metadata"].get(key, {}), **body["metadata"][key]}
                    node["metadata"][key] = {k: v for k, v in merged.items() if v is not None}
        node["metadata"]["resourceVersion"] = str(next(self._rv))
        self.node_watch.record("MODIFIED", node)
        return 200, copy.deepcopy(node)


_MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _event_namespace_refusal(ev: dict[str, Any]) -> str | None:
    """A core/v1 Event lives in its object's namespace; one about a cluster-scoped object in ``default``.

    Same check and message as the API server's event validation (KUBERNETES-API.md); kmend sends
    core/v1 Events without ``eventTime``, so ``kube-system`` is not accepted here.
    """
    ns = ev["metadata"]["namespace"]
    involved = ev["involvedObject"].get("namespace") or ""
    if involved == ns or (not involved and ns == "default"):
        return None
    return (f'Event "{ev["metadata"]["name"]}" is invalid: involvedObject.namespace: '
            f'Invalid value: "{involved}": does not match event.namespace')
