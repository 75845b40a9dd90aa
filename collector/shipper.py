"""Ships signal batches to ``POST /v1/signals``; spools them when the service is away.

Order is kept: while anything waits in the spool, new batches go behind it,
and the spool is replayed oldest first before anything new is posted. A batch
is either accepted, spooled or (only when the service rejects it as malformed,
or the spool drops it past its cap) dropped and counted — never lost silently.

The service refuses a malformed batch whole with a 4xx naming the field. Such a batch
would be refused again on every retry, so it is never retried: it is set aside in the
spool's quarantine folder (the newest few are kept for inspection), counted, and the
batches behind it go on. Only "try later" answers (5xx, 408, 429) and a wrong token
(401/403, fixed by an operator) keep a batch in the spool.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import httpx

from collector.metrics import AgentMetrics
from collector.signal import LogLine, Signal
from collector.sources.base import Clock
from collector.spool import DiskSpool, Value
from collector.wire import to_wire

log = logging.getLogger(__name__)


class Outcome(Enum):
    """What the service did with one POST."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    UNAVAILABLE = "unavailable"


_RETRY_LATER = frozenset({401, 403, 408, 429})
"""4xx answers that change without the batch changing: token fixed, timeout, rate limit."""


MAX_RETRY_AFTER_S = 300.0
"""The longest Retry-After honoured (a larger one is cut to this)."""


def _retry_after(resp: httpx.Response) -> float:
    """The answer's Retry-After in seconds (0 when absent, or not a number of seconds)."""
    try:
        return max(0.0, float(resp.headers.get("retry-after", "0")))
    except ValueError:
        return 0.0


def _wire(sig: Signal) -> dict[str, Any]:
    out = to_wire(sig)
    text = out["payload"].get("text")
    if isinstance(text, str) and "\x00" in text:
        # A NUL read from a log is content, but no store can hold it: shown as U+FFFD instead.
        out["payload"]["text"] = text.replace("\x00", "\ufffd")
    return out


def encode_batch(signals: Sequence[Signal], *, producer: str | None = None, seq: int | None = None) -> bytes:
    """The gzip-compressed JSON body of ``POST /v1/signals`` (numbered `seq` by `producer` when given)."""
    doc: dict[str, Any] = {"signals": [_wire(s) for s in signals]}
    if producer is not None and seq is not None:
        doc |= {"producer": producer, "seq": seq}
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=5)


def telemetry_or_symptom(sig: Signal) -> Value:
    """The default value of a signal: log lines over progress and metric samples."""
    return Value.SYMPTOM if isinstance(sig.payload, LogLine) else Value.TELEMETRY


class Shipper:
    """Posts batches with a bearer token; falls back to the spool with backoff."""

    def __init__(
        self,
        *,
        url: str,
        spool: DiskSpool,
        metrics: AgentMetrics,
        token: str | None = None,
        client: httpx.Client | None = None,
        timeout: float = 5.0,
        clock: Clock = time.monotonic,
        max_backoff: float = 10.0,
        value_of: Callable[[Signal], Value] = telemetry_or_symptom,
        producer: str | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/v1/signals"
        self.producer = producer
        """This agent process's name for its batches: each body carries it and the next number, so the
        service tells a replayed batch in O(1) and keeps no row per signal."""
        self._seq = 0
        self._maybe_taken = False
        self._retry_after = 0.0
        self.spool = spool
        self.metrics = metrics
        self.clock = clock
        self.max_backoff = max_backoff
        self.value_of = value_of
        """What a signal is worth keeping through an outage (the agent marks cause lines)."""
        self._client = client or httpx.Client(timeout=timeout)
        self._headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._backoff = 0.0
        self._retry_at = 0.0
        self._outage_since: float | None = None
        self._dropped_seen = dict(spool.dropped_by_value)
        self._update_gauges()

    def _post(self, body: bytes) -> Outcome:
        self._maybe_taken = False
        self._retry_after = 0.0
        try:
            resp = self._client.post(self.url, content=body, headers=self._headers)
        except httpx.HTTPError as exc:
            log.debug("service unreachable: %s", exc)
            # Refused before anything was sent: surely not taken. A timeout or a dropped answer: maybe.
            self._maybe_taken = not isinstance(exc, httpx.ConnectError)
            return Outcome.UNAVAILABLE
        if resp.is_success:
            return Outcome.ACCEPTED
        if 400 <= resp.status_code < 500 and resp.status_code not in _RETRY_LATER:
            log.error("service rejected a batch (%s), quarantined, not retried: %s", resp.status_code,
                      resp.text[:500])
            return Outcome.REJECTED
        # 401/403 too: a wrong token is fixed by an operator, and the spool waits for it.
        log.warning("service answered %s; spooling", resp.status_code)
        self._maybe_taken = resp.status_code >= 500
        self._retry_after = _retry_after(resp)
        return Outcome.UNAVAILABLE

    def _failed(self) -> None:
        if self._outage_since is None:
            self._outage_since = self.clock()
            log.info("service %s unreachable; spooling to disk (%d signals spooled so far)",
                     self.url, self.spool.signals)
        self.metrics.ship_errors.inc()
        self._backoff = min(self.max_backoff, self._backoff * 2 if self._backoff else 1.0)
        # A busy service says when to come back (Retry-After); a shorter backoff of ours would only queue again.
        self._retry_at = self.clock() + max(self._backoff, min(self._retry_after, MAX_RETRY_AFTER_S))

    def _ok(self) -> None:
        if self._outage_since is not None:
            log.info("service %s reachable again after %.0f s; %d spooled signals left to replay",
                     self.url, self.clock() - self._outage_since, self.spool.signals)
            self._outage_since = None
        self._backoff = 0.0
        self._retry_at = 0.0

    @property
    def reachable(self) -> bool:
        """False while backing off after a failure."""
        return self.clock() >= self._retry_at

    def replay(self) -> bool:
        """Send spooled batches oldest first; True when the spool is empty."""
        while self.reachable:
            batch = self.spool.peek()
            if batch is None:
                return True
            outcome = self._post(self.spool.read(batch))
            if outcome is Outcome.UNAVAILABLE:
                self._failed()
                return False
            self._ok()
            if outcome is Outcome.ACCEPTED:
                self.spool.pop(batch)
                self.metrics.shipped.inc(batch.count)
            else:
                self.spool.quarantine_batch(batch)
                self.metrics.dropped.labels("rejected").inc(batch.count)
            self._update_gauges()
        return self.spool.peek() is None

    def deliver(self, signals: Sequence[Signal]) -> list[Signal]:
        """Ship a batch, or spool it; returns the signals that could be neither (the spool is full of
        signals worth as much), which the caller must keep and offer again."""
        if not signals:
            self.replay()
            return []
        body: bytes | None = None
        if self.replay():
            body = self._encode(signals)
            outcome = self._post(body)
            if outcome is Outcome.ACCEPTED:
                self._ok()
                self.metrics.shipped.inc(len(signals))
                return []
            if outcome is Outcome.REJECTED:
                self._ok()
                self.spool.quarantine(body, len(signals))
                self.metrics.dropped.labels("rejected").inc(len(signals))
                return []
            self._failed()
        by_value: dict[Value, list[Signal]] = {}
        for sig in signals:
            by_value.setdefault(self.value_of(sig), []).append(sig)
        if body is not None and self.producer is not None and self._maybe_taken \
                and self.spool.put(body, len(signals), max(by_value)):
            # The service may have taken this batch: the spool keeps it whole, with its number, so that
            # the replay is recognised instead of analysed twice.
            self.metrics.spooled.inc(len(signals))
            self._update_gauges()
            return []
        refused: list[Signal] = []
        for value in sorted(by_value, reverse=True):  # the most valuable part is offered room first
            part = by_value[value]
            if self.spool.put(self._encode(part), len(part), value):
                self.metrics.spooled.inc(len(part))
            else:
                refused.extend(part)
        self._update_gauges()
        held = {id(s) for s in refused}
        return [s for s in signals if id(s) in held]

    def _encode(self, signals: Sequence[Signal]) -> bytes:
        # Numbered in the order sent: the spool replays oldest first, so the service sees them increasing.
        if self.producer is None:
            return encode_batch(signals)
        self._seq += 1
        return encode_batch(signals, producer=self.producer, seq=self._seq)

    def _update_gauges(self) -> None:
        for value, total in self.spool.dropped_by_value.items():
            new = total - self._dropped_seen.get(value, 0)
            if new:
                self.metrics.dropped.labels(f"spool_full_{value.name.lower()}").inc(new)
                self._dropped_seen[value] = total
        self.metrics.spool_bytes.set(self.spool.size_bytes)
        self.metrics.spool_batches.set(len(self.spool))

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()
