"""The Alertmanager example (deploy/monitoring/alertmanager-example.yaml): `amtool check-config` accepts it, and a real
Alertmanager running it routes what kmend's notifier posts — breaker to on-call, approvals to the approvers, repair
requests to the hardware tooling, the rest to the chat — and every alert the PrometheusRule raises has a route."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from healer.notify import AlertmanagerNotifier, Announcement, announce
from tests.conftest import REPO, free_port
from tests.procs import ALERTMANAGER
from tests.procs import alertmanager as run_alertmanager

EXAMPLE = REPO / "deploy" / "monitoring" / "alertmanager-example.yaml"
AMTOOL = shutil.which("amtool")


def test_amtool_accepts_the_example() -> None:
    if AMTOOL is None:
        pytest.skip("amtool (Debian's prometheus-alertmanager) is not installed (.ci/run installs it)")
    out = subprocess.run([AMTOOL, "check-config", str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


class _Receivers:
    """Loopback endpoints standing in for Slack, the pager bridge and the repair tooling: path = receiver."""

    def __init__(self) -> None:
        self.got: dict[str, list[dict[str, Any]]] = {}
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                got.setdefault(self.path.strip("/"), []).append(body)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[str, _Receivers]]:
    if ALERTMANAGER is None:
        pytest.skip("prometheus-alertmanager is not installed (.ci/run installs it)")
    receivers = _Receivers()
    config = yaml.safe_load(EXAMPLE.read_text())
    # Only where the notifications go, and how long Alertmanager batches them, differ from the example.
    config["route"].update(group_wait="100ms", group_interval="1s")
    for r in config["receivers"]:
        for slack in r.get("slack_configs", []):
            slack["api_url"] = f"{receivers.url}/{r['name']}"
        for hook in r.get("webhook_configs", []):
            hook["url"] = f"{receivers.url}/{r['name']}"
    try:
        with run_alertmanager(tmp_path, config, free_port()) as url:
            yield url, receivers
    finally:
        receivers.server.shutdown()


def _alertnames(bodies: list[dict[str, Any]]) -> set[str]:
    names = set()
    for body in bodies:
        if "alerts" in body:  # webhook
            names |= {a["labels"]["alertname"] for a in body["alerts"]}
        else:  # Slack: the title template names the alert
            names |= {a.get("title", "").split()[0] for a in body.get("attachments", [])}
            names |= {"(approval text)" for a in body.get("attachments", []) if "kmend approve" in a.get("text", "")}
    return names


def test_a_real_alertmanager_routes_kmends_notifications(routed: tuple[str, _Receivers]) -> None:
    url, receivers = routed
    notifier = AlertmanagerNotifier(url)
    announce(notifier, Announcement.BREAKER_TRIPPED, {"message": "breaker tripped: 4 of 32 nodes out", "ts": 1.7e9})
    announce(notifier, Announcement.NEEDS_APPROVAL, {"message": "plan plan-7 waits for approval", "plan": "plan-7",
                                                    "node": "gpu-node-03", "ts": 1.7e9})
    announce(notifier, Announcement.PLAN_CREATED, {"message": "plan created", "plan": "plan-8", "node": "gpu-node-04",
                                                  "ts": 1.7e9})
    notifier.notify({"event": "repair_requested", "node": "gpu-node-05", "plan": "plan-9", "message": "replace",
                     "ts": 1.7e9})
    deadline = time.monotonic() + 30
    wanted = {"gpu-oncall", "gpu-approvers", "gpu-ops-chat", "hardware-tickets"}
    while set(receivers.got) < wanted and time.monotonic() < deadline:
        time.sleep(0.1)
    got = receivers.got
    assert set(got) == wanted, got
    assert _alertnames(got["gpu-oncall"]) == {"KmendBreakerTripped"}
    assert _alertnames(got["hardware-tickets"]) == {"KmendRepairRequested"}
    assert _alertnames(got["gpu-ops-chat"]) == {"KmendPlanCreated"}
    assert "(approval text)" in _alertnames(got["gpu-approvers"])  # the text tells the approver what to type
    assert "kmend approve plan-7" in json.dumps(got["gpu-approvers"])


def test_every_alert_of_the_prometheus_rule_reaches_a_receiver() -> None:
    rules = yaml.safe_load((REPO / "deploy" / "helm" / "kmend" / "files" / "prometheus-rules.yaml").read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    routes = yaml.safe_load(EXAMPLE.read_text())["route"]["routes"]
    paged = {n for n in names if any(n in m for r in routes if r["receiver"] == "gpu-oncall" for m in r["matchers"])}
    # The alerts that mean kmend stopped acting page; the rest go to the chat (the default route).
    assert {"KmendBreakerTripped", "KmendPlanFailed", "KmendServiceDown", "KmendNoLeader", "KmendHealerStuck"} <= paged
