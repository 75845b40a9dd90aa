"""Text given to ``kmend rules test`` turned into the signals the service would receive."""

from __future__ import annotations

import io
import json
import time
from dataclasses import replace

from collector.bundle import BundleSource, LogKind
from collector.metric_files import looks_like_scrape, sample_json_signals, scrape_signals, webhook_signals
from collector.signal import Signal


def events_of(text: str, *, source: str | None, node: str) -> list[Signal]:
    """An Alertmanager webhook body, JSON metric samples, Prometheus text, or else log events (:func:`log_events`)."""
    now = time.time()
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        try:
            doc = json.loads(stripped)
        except ValueError:
            doc = None
        if doc is not None:
            hook = webhook_signals(stripped, node=node, ts=now)
            if hook is not None:
                return hook
            samples = sample_json_signals(doc, node=node, ts=now)
            if samples is not None:
                return samples
            raise ValueError("JSON is neither an Alertmanager webhook body nor metric samples "
                             "({\"name\", \"value\", \"labels\"})")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if looks_like_scrape("", lines):
        return scrape_signals("input", "\n".join(lines) + "\n", node=None, ts=now, default_node=node)
    return log_events(text, source=source, node=node)


def log_events(text: str, *, source: str | None, node: str) -> list[Signal]:
    """Log text read as ``kmend analyze`` reads a file: container-runtime, kubectl and transport prefixes off,
    lines a terminal or forum wrapped joined back, multi-line events (AER dumps, NVRM messages, tracebacks)
    folded into one; ``node`` for the events whose line names none."""
    bundle = BundleSource(["-"], stdin=io.BytesIO(text.encode()))
    [file] = bundle.files()
    file = replace(file, kind=LogKind(source) if source else LogKind.AUTO, node_hint=node)
    lines = bundle.lines(file)
    return [bundle.signal(lines, i) for i, event in enumerate(lines.texts) if event.strip()]
