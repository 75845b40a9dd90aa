"""A small Kubernetes API server on loopback, for running KubeCluster through the real client.

It implements just what the Cluster port uses, with the behaviour of
../shared/KUBERNETES-API.md: strategic-merge patches on nodes (taints replaced
whole, a stale ``metadata.resourceVersion`` gets 409), node conditions only
through ``/status`` (merged by type; a plain patch ignores ``status``), events
with ``generateName``. Errors can be queued per method and path to test retries.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeApiServer:
    """Serve on 127.0.0.1:<free port>; `url` is the base URL for a kubeconfig/Configuration."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self._rv = itertools.count(100)
        self._errors: deque[tuple[str, re.Pattern[str], int, str]] = deque()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null")
                path = self.path.split("?", 1)[0]
                code, out = server.handle(method, path, body, self.headers.get("Content-Type", ""))
                self._send(code, out)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- test controls -------------------------------------------------------------

    def fail(self, method: str, path_regex: str, status: int, message: str = "injected") -> None:
        """Answer the next matching request with this status."""
        self._errors.append((method, re.compile(path_regex), status, message))

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        """Create a Ready node directly (as if a kubelet had registered it)."""
        self.handle("POST", "/api/v1/nodes", {"metadata": {"name": name, "labels": labels or {}}}, "")
        self.nodes[name]["status"]["conditions"] = [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]
        self.nodes[name]["spec"]["taints"] = []

    # -- the API -------------------------------------------------------------------

    @staticmethod
    def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                      "message": message, "code": code}

    def handle(self, method: str, path: str, body: Any, ctype: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests.append((method, path))
            for i, (m, rx, code, msg) in enumerate(self._errors):
                if m == method and rx.search(path):
                    del self._errors[i]
                    return self._status(code, "Injected", msg)
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
                del self.nodes[name]
                return 200, {"kind": "Status", "status": "Success"}
            if method == "PATCH":
                if "strategic-merge-patch" not in ctype and "merge-patch" not in ctype:
                    return self._status(415, "UnsupportedMediaType", f"unsupported patch type {ctype}")
                return self._patch_node(node, body, status)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path)
        if m and method == "POST":
            ev = copy.deepcopy(body)
            meta = ev.setdefault("metadata", {})
            meta["name"] = meta.get("name") or meta.pop("generateName", "event-") + uuid.uuid4().hex[:5]
            meta["namespace"] = m.group(1)
            if not ev.get("involvedObject", {}).get("name"):
                return self._status(422, "Invalid", "involvedObject.name: Required value")
            self.events.append(ev)
            return 201, ev
        return self._status(404, "NotFound", f"the server could not find the requested resource {path}")

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
                for t in spec["taints"]:
                    if set(t) - {"key", "value", "effect", "timeAdded"}:
                        return self._status(400, "BadRequest", f"unknown field in taint: {sorted(t)}")
                node["spec"]["taints"] = spec["taints"]
            for key in ("labels", "annotations"):
                if key in body.get("metadata", {}):
                    merged = {**node["metadata"].get(key, {}), **body["metadata"][key]}
                    node["metadata"][key] = {k: v for k, v in merged.items() if v is not None}
        node["metadata"]["resourceVersion"] = str(next(self._rv))
        return 200, copy.deepcopy(node)
