"""The scheduler's thin Kubernetes client (healer/kube/rest.py): each request carries the token the client's
configuration holds at that moment (refreshed through its hook, as in-cluster token rotation and exec plugins do),
names go quoted into their path segment, and an error answer raises the client's ApiException with the server's
status and message, as the generated methods did."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from healer.cluster import NotFoundError
from healer.gang.records import PodRecord
from healer.kube.pods import KubePodScheduling
from healer.kube.rest import Rest, path


class _Recorder(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, str, Any]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append((self.command, self.path, self.headers.get("authorization", ""), body))
        code, out = (404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": 'pods "gone" not found'}) \
            if "gone" in self.path else (201, {"kind": "Status", "status": "Success"})
        data = json.dumps(out).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Recorder.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def _pod(name: str) -> PodRecord:
    return PodRecord(namespace="team a", name=name, uid="u-1", requests={}, node_name="", scheduler_name="kmend",
                     terminating=False, finished=False, labels={}, annotations={}, tolerations=(), node_selector={},
                     affinity=(), priority=0, created=0.0)


def test_each_bind_carries_the_token_the_configuration_holds_then(server: str) -> None:
    cfg = client.Configuration(host=server)
    tokens = iter(["first", "rotated"])

    def refresh(conf: client.Configuration) -> None:
        conf.api_key = {"authorization": next(tokens)}
        conf.api_key_prefix = {"authorization": "Bearer"}

    cfg.api_key = {"authorization": "expired"}  # as the kubeconfig loader leaves it, with its refresh hook
    cfg.refresh_api_key_hook = refresh
    port = KubePodScheduling(client.ApiClient(cfg), clock=lambda: 0.0)
    port.bind(_pod("w-0"), "n1")
    port.bind(_pod("w-1"), "n1")
    (m0, p0, auth0, body0), (_, _, auth1, _) = _Recorder.seen
    assert (auth0, auth1) == ("Bearer first", "Bearer rotated")
    assert m0 == "POST" and p0 == "/api/v1/namespaces/team%20a/pods/w-0/binding?fieldValidation=Strict"
    assert body0 == {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "w-0", "uid": "u-1"},
                     "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}


def test_an_error_answer_is_the_clients_exception_with_the_servers_message(server: str) -> None:
    rest = Rest(client.ApiClient(client.Configuration(host=server)))
    with pytest.raises(ApiException) as caught:
        rest.call("GET", path("api", "v1", "namespaces", "t", "pods", "gone"), timeout=5)
    assert caught.value.status == 404
    assert json.loads(caught.value.body or "{}")["message"] == 'pods "gone" not found'
    port = KubePodScheduling(client.ApiClient(client.Configuration(host=server)), clock=lambda: 0.0)
    with pytest.raises(NotFoundError, match='pods "gone" not found'):
        port.bind(_pod("gone"), "n1")
    assert path("a/b", "c d") == "/a%2Fb/c%20d"
