"""Text given to ``kmend rules test`` turned into the signals the service would receive."""

from __future__ import annotations

import json
import time

from collector.metric_files import looks_like_scrape, sample_json_signals, scrape_signals, webhook_signals
from collector.signal import LogLine, Signal, Source


def events_of(text: str, *, source: str | None, node: str) -> list[Signal]:
    """An Alertmanager webhook body, JSON metric samples, Prometheus text, or else log lines."""
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
    src = Source(source) if source else Source.KERNEL
    return [Signal(f"{node}/test/{i}", node, src, now, LogLine(ln)) for i, ln in enumerate(lines)]
