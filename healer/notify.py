"""Notifiers: where NOTIFY steps and plan lifecycle announcements go."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any, Protocol

import httpx

log = logging.getLogger("kmend.notify")


class Notifier(Protocol):
    """Delivers a notification; raises on failure so the step is retried or marked failed."""

    def notify(self, payload: Mapping[str, Any]) -> None:
        """Send one notification."""
        ...


class Announcement(StrEnum):
    """Plan lifecycle events operators are told about."""

    PLAN_CREATED = "plan_created"
    NEEDS_APPROVAL = "plan_needs_approval"
    PLAN_DONE = "plan_done"
    PLAN_FAILED = "plan_failed"
    PLAN_BLOCKED = "plan_blocked"
    BREAKER_TRIPPED = "breaker_tripped"


class LogNotifier:
    """Writes notifications to the service log (the default when no webhook is set)."""

    def __init__(self) -> None:
        self.sent: list[Mapping[str, Any]] = []

    def notify(self, payload: Mapping[str, Any]) -> None:
        self.sent.append(dict(payload))
        log.warning("notification: %s", payload.get("message", payload))


class WebhookNotifier:
    """POSTs notifications as JSON to a generic webhook."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, client: httpx.Client | None = None) -> None:
        self.url = url
        self.client = client or httpx.Client(timeout=timeout_s)

    def notify(self, payload: Mapping[str, Any]) -> None:
        resp = self.client.post(self.url, json=dict(payload))
        resp.raise_for_status()


def alertmanager_alert(payload: Mapping[str, Any], *, generator_url: str = "") -> dict[str, Any]:
    """One alert in Alertmanager's ``POST /api/v2/alerts`` shape (labels identify it, annotations describe it)."""
    event = str(payload.get("event", "notification"))
    labels = {"alertname": "Kmend" + "".join(p.capitalize() for p in event.split("_")),
              "severity": "critical" if event in ("breaker_tripped", "plan_failed", "plan_blocked") else "warning"}
    for k in ("node", "job", "namespace", "plan", "incident", "fault_class"):
        if payload.get(k):
            labels[k] = str(payload[k])
    start = dt.datetime.fromtimestamp(float(payload.get("ts") or dt.datetime.now(dt.UTC).timestamp()), dt.UTC)
    alert: dict[str, Any] = {
        "labels": labels,
        "annotations": {"summary": str(payload.get("message", event))[:1000],
                        "description": str(payload.get("reason", ""))[:2000]},
        "startsAt": start.isoformat().replace("+00:00", "Z"),
    }
    if event in ("plan_done",):
        alert["endsAt"] = alert["startsAt"]  # resolved at once: it is information, not a standing problem
    if generator_url:
        alert["generatorURL"] = generator_url
    return alert


class AlertmanagerNotifier:
    """POSTs each notification as one alert to Alertmanager's v2 API."""

    def __init__(self, base_url: str, *, timeout_s: float = 5.0, client: httpx.Client | None = None,
                 generator_url: str = "") -> None:
        self.url = base_url.rstrip("/") + "/api/v2/alerts"
        self.client = client or httpx.Client(timeout=timeout_s)
        self.generator_url = generator_url

    def notify(self, payload: Mapping[str, Any]) -> None:
        resp = self.client.post(self.url, json=[alertmanager_alert(payload, generator_url=self.generator_url)])
        resp.raise_for_status()


class FanOut:
    """Sends to every notifier; fails (so the step retries) only when all of them failed."""

    def __init__(self, notifiers: Sequence[Notifier]) -> None:
        self.notifiers = list(notifiers)

    def notify(self, payload: Mapping[str, Any]) -> None:
        errors = []
        for n in self.notifiers:
            try:
                n.notify(payload)
            except Exception as exc:  # one sink down must not silence the others
                log.warning("notifier %s failed: %s", type(n).__name__, exc)
                errors.append(exc)
        if errors and len(errors) == len(self.notifiers):
            raise errors[0]


def announce(notifier: Notifier, what: Announcement, payload: Mapping[str, Any]) -> None:
    """Best effort: a lifecycle announcement that cannot be delivered is logged, never raised."""
    try:
        notifier.notify({"event": what.value, **payload})
    except Exception as exc:
        log.warning("could not announce %s: %s", what.value, exc)
