"""Notifiers: where NOTIFY steps go."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import httpx

log = logging.getLogger("kmend.notify")


class Notifier(Protocol):
    """Delivers a notification; raises on failure so the step is retried or marked failed."""

    def notify(self, payload: Mapping[str, Any]) -> None:
        """Send one notification."""
        ...


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
