"""Auth: every route but /healthz and /readyz needs a token of the right kind; TokenReview; open mode is loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from healer.identity import Identity, StaticTokenReviewer
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID79, kernel
from tests.conftest import free_port
from tests.hostile import serve

TOKENS = {"ingest_token": "ingest-secret", "reader_token": "reader-secret", "operator_token": "operator-secret"}
INGEST = {"authorization": "Bearer ingest-secret"}
READER = {"authorization": "Bearer reader-secret"}
OPERATOR = {"authorization": "Bearer operator-secret", "x-kmend-operator": "bob"}
OPEN_ROUTES = {"/healthz", "/readyz"}
REPO = Path(__file__).resolve().parent.parent


def _routes(client: httpx.Client) -> list[tuple[str, str]]:
    schema = client.get("/openapi.json", headers=READER).json()
    out = []
    for path, ops in schema["paths"].items():
        for method in ops:
            out.append((method.upper(), re.sub(r"\{[^}]+\}", "x", path)))
    return out


def test_every_route_but_health_needs_a_token(tmp_path: Path) -> None:
    with serve(tmp_path, **TOKENS) as s:
        routes = _routes(s.client)
        assert len(routes) >= 20 and ("GET", "/v1/incidents") in routes and ("GET", "/metrics") in routes
        for method, path in [*routes, ("GET", "/openapi.json"), ("GET", "/docs")]:
            r = s.client.request(method, path, json={}, headers={"authorization": ""})
            if path in OPEN_ROUTES:
                assert r.status_code in (200, 503), (method, path)
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                wrong = s.client.request(method, path, json={}, headers={"authorization": "Bearer guess"})
                assert wrong.status_code == 401, (method, path)


def test_a_reader_reads_and_changes_nothing(tmp_path: Path) -> None:
    with serve(tmp_path, **TOKENS) as s:
        assert s.post([kernel("gpu-node-01", XID79, ts=time.time())], headers=INGEST).status_code == 200
        incs = s.client.get("/v1/incidents", headers=READER).json()["incidents"]
        assert incs and s.client.get(f"/v1/incidents/{incs[0]['id']}", headers=READER).status_code == 200
        assert s.client.get("/v1/nodes", headers=READER).status_code == 200
        assert "kmend_ingest_signals_total" in s.client.get("/metrics", headers=READER).text
        assert s.client.post("/v1/nodes/gpu-node-02/quarantine", headers=READER).status_code == 403
        assert s.client.post("/v1/breaker/reset", headers=READER).status_code == 403
        assert s.post([kernel("gpu-node-03", XID79)], headers=READER).status_code == 403
        # The collectors' token reads nothing; an operator may read too.
        assert s.client.get("/v1/incidents", headers=INGEST).status_code == 403
        assert s.client.get("/v1/incidents", headers=OPERATOR).status_code == 200


def test_runbook_calls_are_audited_with_the_identity_that_made_them(tmp_path: Path) -> None:
    with serve(tmp_path, **TOKENS) as s:
        assert s.client.post("/v1/nodes/gpu-node-02/quarantine", headers=OPERATOR).status_code == 200
        assert s.client.post("/v1/nodes/gpu-node-03/quarantine", headers={"x-kmend-operator": "mallory"}) \
            .status_code == 401
        audit = s.client.get("/v1/audit", headers=OPERATOR).json()["entries"]
        got = {(a["actor"], a["path"], a["status"]) for a in audit}
        assert ("operator-token (bob)", "/v1/nodes/gpu-node-02/quarantine", 200) in got
        assert ("unauthenticated (mallory)", "/v1/nodes/gpu-node-03/quarantine", 401) in got


def test_kubernetes_tokens_are_checked_with_token_review_and_cached(tmp_path: Path) -> None:
    sa = "system:serviceaccount:monitoring:grafana"
    reviewer = StaticTokenReviewer({
        "grafana-sa-token": Identity(sa, frozenset({"system:serviceaccounts:monitoring"})),
        "oncall-token": Identity("alice@example.com", frozenset({"sre"})),
        "stranger-token": Identity("system:serviceaccount:default:default"),
    })
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", token_review=True,
                        token_review_readers=["system:serviceaccounts:monitoring"], token_review_operators=["sre"])
    kmend = make_kmend(settings, cluster=build_cluster(4))
    app = create_app(kmend, settings, token_reviewer=reviewer)
    with serve_in_thread(app) as url, httpx.Client(base_url=url) as c:
        for _ in range(5):
            assert c.get("/v1/incidents", headers={"authorization": "Bearer grafana-sa-token"}).status_code == 200
        assert reviewer.calls == 1  # cached
        assert c.post("/v1/breaker/reset", headers={"authorization": "Bearer grafana-sa-token"}).status_code == 403
        assert c.post("/v1/breaker/reset", headers={"authorization": "Bearer oncall-token"}).status_code == 200
        assert c.get("/v1/incidents", headers={"authorization": "Bearer stranger-token"}).status_code == 403
        assert c.get("/v1/incidents", headers={"authorization": "Bearer forged"}).status_code == 401
        audit = c.get("/v1/audit", headers={"authorization": "Bearer oncall-token"}).json()["entries"]
        assert ("alice@example.com", "/v1/breaker/reset") in {(a["actor"], a["path"]) for a in audit}
    kmend.store.close()


class _TokenReviewAPI(BaseHTTPRequestHandler):
    """The API server's TokenReview endpoint, as documented: the review comes back with its status."""

    def do_POST(self) -> None:
        assert self.path == "/apis/authentication.k8s.io/v1/tokenreviews"
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ok = review["spec"]["token"] == "sa-token"
        review["status"] = {"authenticated": True, "user": {
            "username": "system:serviceaccount:ops:oncall", "uid": "7",
            "groups": ["system:serviceaccounts", "system:serviceaccounts:ops"]}} if ok else {"authenticated": False}
        body = json.dumps(review).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_kube_token_reviewer_speaks_the_tokenreview_api() -> None:
    from kubernetes import client

    from healer.kube.tokenreview import KubeTokenReviewer

    server = HTTPServer(("127.0.0.1", 0), _TokenReviewAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{server.server_port}"
        reviewer = KubeTokenReviewer(client.ApiClient(cfg))
        ident = reviewer.review("sa-token")
        assert ident is not None and ident.username == "system:serviceaccount:ops:oncall"
        assert "system:serviceaccounts:ops" in ident.groups
        assert reviewer.review("forged") is None
    finally:
        server.shutdown()


def test_serve_without_tokens_listens_on_loopback_only_and_says_so_loudly(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KMEND_")}
    env.update({"KMEND_HOST": "0.0.0.0", "KMEND_PORT": str(port), "KMEND_CLUSTER": "sim",
                "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"})
    proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            out.append(line)
            if "Uvicorn running on" in line or proc.poll() is not None:
                break
        text = "".join(out)
        assert "NO API TOKENS CONFIGURED" in text and "not 0.0.0.0" in text
        assert f"Uvicorn running on http://127.0.0.1:{port}" in text
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


@pytest.mark.parametrize("kind", ["INGEST", "OPERATOR", "READER"])
def test_the_deployment_sets_every_token_from_a_secret(kind: str) -> None:
    manifest = REPO / "deploy" / "service" / "kmend.yaml"
    [dep] = [d for d in yaml.safe_load_all(manifest.read_text()) if d and d["kind"] == "Deployment"]
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "secretKeyRef" in env[f"KMEND_{kind}_TOKEN"]["valueFrom"]
