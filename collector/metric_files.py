"""Metric and alert files in an offline bundle: exporter scrapes and Alertmanager webhook bodies.

A saved ``curl localhost:9400/metrics`` (DCGM exporter), the agent's NVML/IB samples in
the same text format, or a captured Alertmanager notification become the signals the
service would have received, so ``kmend analyze`` diagnoses them like ``kmend serve``.
Several scrapes may be concatenated in one file: a sample repeated for the same series
starts the next scrape, ``seconds_apart`` later (or at the sample's own timestamp).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from pydantic import ValidationError

from collector.alertmanager import WebhookIn, alert_to_signal
from collector.exposition import exposition_samples, gpu_labels
from collector.signal import MetricSample, Signal, Source

_EXPOSITION_START = ("# HELP ", "# TYPE ", "DCGM_", "nvml_", "ib_")
# A sample line: a metric name, optional labels, then a value. A log line that merely opens with
# one of the prefixes above (UCX's "ib_mlx5_log.c:139  Transport retry ...") is not a scrape.
_SAMPLE_LINE = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*(?:\{[^}\n]*\})?"
                          r"(?:[ \t]+[-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|NaN|Inf)(?:[ \t]+-?[0-9]+)?)?[ \t]*")


def looks_like_scrape(name: str, texts: Sequence[str]) -> bool:
    """A Prometheus text scrape: a ``.prom`` file, or one that opens like exporter output."""
    first = next((t for t in texts if t.strip()), "")
    if name.endswith(".prom") or first.startswith(("# HELP ", "# TYPE ")):
        return True
    return first.startswith(_EXPOSITION_START) and _SAMPLE_LINE.fullmatch(first.strip()) is not None


def _source(name: str) -> Source:
    return Source.DCGM if name.startswith("DCGM_") else Source.IB if name.startswith("ib_") else Source.NVML


def scrape_signals(name: str, text: str, *, node: str | None, ts: float, seconds_apart: float = 15.0,
                   default_node: str = "unknown") -> list[Signal]:
    """The samples of one or more concatenated scrapes; node from the flag/path or the ``Hostname`` label."""
    out: list[Signal] = []
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    scrape = 0
    for s in exposition_samples(text):
        key = (s.name, tuple(sorted(s.labels.items())))
        if key in seen:
            scrape += 1
            seen.clear()
        seen.add(key)
        labels = gpu_labels(s.labels)
        where = node or labels.get("Hostname") or default_node
        at = s.timestamp if s.timestamp is not None else ts + scrape * seconds_apart
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).hexdigest()
        out.append(Signal(f"{where}/file/{name}/{digest}/{scrape}", where, _source(s.name), at,
                          MetricSample(s.name, s.value, labels)))
    return out


def webhook_signals(text: str, *, node: str | None, ts: float) -> list[Signal] | None:
    """The alerts of an Alertmanager webhook body, or None when the text is not one."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("alerts"), list):
        return None
    try:
        hook = WebhookIn.model_validate(doc)
    except ValidationError:
        return None
    return [s for a in hook.alerts if (s := alert_to_signal(a, default_node=node, now=ts)) is not None]


def sample_json_signals(doc: object, *, node: str | None, ts: float) -> list[Signal] | None:
    """Metric samples written as JSON (``{"name", "value", "labels"}`` or a list of them), else None."""
    items = doc if isinstance(doc, list) else [doc]
    out: list[Signal] = []
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                and isinstance(item.get("value"), int | float)):
            return None
        labels = {str(k): str(v) for k, v in (item.get("labels") or {}).items()}
        where = str(item.get("node") or node or labels.get("Hostname") or "unknown")
        name = item["name"]
        source = Source(item["source"]) if item.get("source") in {s.value for s in Source} else _source(name)
        at = float(item.get("ts", ts + i * 15.0))
        out.append(Signal(f"{where}/json/{i}", where, source, at,
                          MetricSample(name, float(item["value"]), gpu_labels(labels))))
    return out
