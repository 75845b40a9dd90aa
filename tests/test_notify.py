"""Outbound notifications: generic JSON webhook and Alertmanager v2 alerts, received by a loopback HTTP server."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from healer.notify import AlertmanagerNotifier, Announcement, FanOut, WebhookNotifier, announce


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    got: list[tuple[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body))
            self.send_response(500 if self.path == "/broken" else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", got
    httpd.shutdown()
    httpd.server_close()


def test_breaker_trip_reaches_webhook_and_alertmanager(receiver: tuple[str, list[tuple[str, Any]]]) -> None:
    url, got = receiver
    fan = FanOut([WebhookNotifier(f"{url}/hook"), AlertmanagerNotifier(url)])
    announce(fan, Announcement.BREAKER_TRIPPED, {"plan": "plan-1", "node": "gpu-node-12", "ts": 1_700_000_000.0,
                                                 "message": "kmend breaker tripped", "reason": "5 of 40 GPU nodes"})
    (am_path, alerts), (hook_path, hook) = sorted(got, key=lambda g: g[0])
    assert hook_path == "/hook" and hook["event"] == "breaker_tripped" and hook["node"] == "gpu-node-12"
    assert am_path == "/api/v2/alerts"
    [alert] = alerts
    assert alert["labels"] == {"alertname": "KmendBreakerTripped", "severity": "critical", "node": "gpu-node-12",
                               "plan": "plan-1"}
    assert alert["annotations"]["description"] == "5 of 40 GPU nodes"
    assert alert["startsAt"] == "2023-11-14T22:13:20Z" and "endsAt" not in alert


def test_one_sink_down_does_not_silence_the_other(receiver: tuple[str, list[tuple[str, Any]]]) -> None:
    url, got = receiver
    FanOut([WebhookNotifier(f"{url}/broken"), WebhookNotifier(f"{url}/ok")]).notify({"event": "plan_done"})
    assert sorted(p for p, _ in got) == ["/broken", "/ok"]
    with pytest.raises(Exception, match="500"):
        FanOut([WebhookNotifier(f"{url}/broken")]).notify({"event": "plan_failed"})
