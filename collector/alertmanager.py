"""Alertmanager webhook payloads (version 4) mapped to signals (source ``alert``).

Typical senders are Prometheus rules over DCGM exporter metrics, so node and
GPU come from the labels those carry (``Hostname``, ``instance``, ``node``,
``kubernetes_node``; ``gpu``, ``UUID``, ``pci_bus_id``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from collector.signal import MetricSample, Signal, Source
from collector.sources.cri import TimestampParser

NODE_LABELS = ("node", "kubernetes_node", "Hostname", "hostname", "nodename", "instance")
"""Label names that name the node, most specific first (``instance`` loses its port)."""


class AlertIn(BaseModel):
    """One alert of a webhook notification."""

    model_config = ConfigDict(extra="allow")

    status: str = Field(pattern="^(firing|resolved)$")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: str = ""


class WebhookIn(BaseModel):
    """Alertmanager's webhook body (``version`` "4")."""

    model_config = ConfigDict(extra="allow")

    version: str = "4"
    groupKey: str = ""
    status: str = ""
    receiver: str = ""
    alerts: list[AlertIn] = Field(default_factory=list, max_length=10000)


def _time(text: str) -> float | None:
    # Go's zero time ("0001-01-01T00:00:00Z") means "not set".
    if not text or text.startswith("0001-"):
        return None
    return TimestampParser()(text)


def node_of(labels: dict[str, str]) -> str | None:
    """The node an alert is about, from its labels."""
    for key in NODE_LABELS:
        value = labels.get(key)
        if value:
            return value.rsplit(":", 1)[0] if key == "instance" and value.count(":") == 1 else value
    return None


def alert_to_signal(alert: AlertIn, *, default_node: str | None, now: float) -> Signal | None:
    """A firing (value 1) or resolved (value 0) alert as a metric sample named after it."""
    node = node_of(alert.labels) or default_node
    if not node:
        return None
    firing = alert.status == "firing"
    ts = (_time(alert.startsAt) if firing else _time(alert.endsAt) or _time(alert.startsAt)) or now
    labels: dict[str, Any] = dict(alert.labels)
    labels["status"] = alert.status
    for src, dst in (("UUID", "uuid"), ("pci_bus_id", "pci"), ("Hostname", "hostname")):
        if src in labels:
            labels.setdefault(dst, labels[src])
    for key in ("summary", "description"):
        if key in alert.annotations:
            labels[key] = alert.annotations[key][:1024]
    fingerprint = alert.fingerprint or hashlib.sha256(
        repr(sorted(alert.labels.items())).encode()).hexdigest()[:16]
    sid = f"alert/{fingerprint[:64]}/{alert.startsAt[:40]}/{alert.status}"
    name = alert.labels.get("alertname", "alert")
    return Signal(sid, node, Source.ALERT, ts, MetricSample(name, 1.0 if firing else 0.0,
                                                              {k: str(v) for k, v in labels.items()}))
