"""Values a signal may hold: what every store and every later stage can take.

Kubernetes node names (DNS-1123 subdomain: lowercase letters, digits, '-' and '.', at most
253 characters, labels of at most 63), finite numbers, text without NUL (PostgreSQL text
cannot hold it), and times no further ahead of the receiver's clock than a skew window.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from collector.signal import LogLine, MetricSample, ProgressSample, Signal

_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
NODE_NAME_PATTERN = rf"^{_LABEL}(?:\.{_LABEL})*$"
"""A DNS-1123 subdomain with labels of at most 63 characters (length checked apart: at most 253)."""
_SUBDOMAIN = re.compile(NODE_NAME_PATTERN)
MAX_NODE_NAME = 253


def node_name_problem(name: str) -> str | None:
    """Why `name` is not a Kubernetes node name (DNS-1123 subdomain), or None."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_NODE_NAME:
        return f"longer than {MAX_NODE_NAME} characters"
    if any(len(label) > 63 for label in name.split(".")):
        return "has a label longer than 63 characters"
    if not _SUBDOMAIN.match(name):
        return "must be a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', starting and ending alphanumeric)"
    return None


def text_problem(text: str) -> str | None:
    """Why `text` cannot be stored, or None."""
    return "contains a NUL character" if "\x00" in text else None


def signal_problem(sig: Signal) -> str | None:
    """The first field of `sig` that no store can hold, as ``field: why``, or None."""
    if (why := node_name_problem(sig.node)) is not None:
        return f"node: {why}"
    if not math.isfinite(sig.ts) or sig.ts <= 0:
        return "ts: must be a finite positive number of seconds"
    if (why := text_problem(sig.id)) is not None:
        return f"id: {why}"
    p = sig.payload
    texts: list[tuple[str, str | None]]
    if isinstance(p, LogLine):
        texts = [("text", p.text), ("namespace", p.namespace), ("pod", p.pod), ("container", p.container),
                 ("job", p.job)]
    elif isinstance(p, MetricSample):
        if not math.isfinite(p.value):
            return "payload.value: must be a finite number"
        texts = [("name", p.name), *((f"labels.{k[:64]}", f"{k}{v}") for k, v in p.labels.items())]
    elif isinstance(p, ProgressSample):
        if p.step_time is not None and not math.isfinite(p.step_time):
            return "payload.step_time: must be a finite number"
        if not all(math.isfinite(v) for v in p.phases.values()):
            return "payload.phases: must be finite numbers"
        texts = [("job", p.job), ("namespace", p.namespace)]
    else:
        texts = []
    for field, value in texts:
        if value is not None and (why := text_problem(value)) is not None:
            return f"payload.{field}: {why}"
    return None


def bound_time(sig: Signal, now: float, max_skew_s: float) -> Signal:
    """`sig` with a time no later than `now` + `max_skew_s`.

    A signal stamped further ahead (a wrong clock, or a hostile sender) takes the receiver's
    time; the time it was sent with is kept in ``sent_ts`` for display. Past times are kept:
    a spool replayed after an outage is old, not wrong.
    """
    if math.isfinite(sig.ts) and sig.ts <= now + max_skew_s:
        return sig
    return replace(sig, ts=now, sent_ts=sig.ts if math.isfinite(sig.ts) else None)
