"""Ships signal batches to ``POST /v1/signals``; spools them when the service is away.

Order is kept: while anything waits in the spool, new batches go behind it,
and the spool is replayed oldest first before anything new is posted. A batch
is either accepted, spooled or (only when the service rejects it as malformed,
or the spool drops it past its cap) dropped and counted — never lost silently.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Sequence
from enum import Enum

import httpx

from collector.metrics import AgentMetrics
from collector.signal import Signal
from collector.sources.base import Clock
from collector.spool import DiskSpool
from collector.wire import to_wire

log = logging.getLogger(__name__)


class Outcome(Enum):
    """What the service did with one POST."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    UNAVAILABLE = "unavailable"


def encode_batch(signals: Sequence[Signal]) -> bytes:
    """The gzip-compressed JSON body of ``POST /v1/signals``."""
    doc = {"signals": [to_wire(s) for s in signals]}
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=5)


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
    ) -> None:
        self.url = url.rstrip("/") + "/v1/signals"
        self.spool = spool
        self.metrics = metrics
        self.clock = clock
        self.max_backoff = max_backoff
        self._client = client or httpx.Client(timeout=timeout)
        self._headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._backoff = 0.0
        self._retry_at = 0.0
        self._outage_since: float | None = None
        self._dropped_seen = spool.dropped_signals
        self._update_gauges()

    def _post(self, body: bytes) -> Outcome:
        try:
            resp = self._client.post(self.url, content=body, headers=self._headers)
        except httpx.HTTPError as exc:
            log.debug("service unreachable: %s", exc)
            return Outcome.UNAVAILABLE
        if resp.is_success:
            return Outcome.ACCEPTED
        if resp.status_code in (400, 413, 422):
            log.error("service rejected a batch (%s): %s", resp.status_code, resp.text[:500])
            return Outcome.REJECTED
        # 401/403 too: a wrong token is fixed by an operator, and the spool waits for it.
        log.warning("service answered %s; spooling", resp.status_code)
        return Outcome.UNAVAILABLE

    def _failed(self) -> None:
        if self._outage_since is None:
            self._outage_since = self.clock()
            log.info("service %s unreachable; spooling to disk (%d signals spooled so far)",
                     self.url, self.spool.signals)
        self.metrics.ship_errors.inc()
        self._backoff = min(self.max_backoff, self._backoff * 2 if self._backoff else 1.0)
        self._retry_at = self.clock() + self._backoff

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
            self.spool.pop(batch)
            if outcome is Outcome.ACCEPTED:
                self.metrics.shipped.inc(batch.count)
            else:
                self.metrics.dropped.labels("rejected").inc(batch.count)
            self._update_gauges()
        return self.spool.peek() is None

    def deliver(self, signals: Sequence[Signal]) -> None:
        """Ship a batch, or spool it; returns once it is one or the other."""
        if not signals:
            self.replay()
            return
        body = encode_batch(signals)
        if self.replay():
            outcome = self._post(body)
            if outcome is Outcome.ACCEPTED:
                self._ok()
                self.metrics.shipped.inc(len(signals))
                return
            if outcome is Outcome.REJECTED:
                self._ok()
                self.metrics.dropped.labels("rejected").inc(len(signals))
                return
            self._failed()
        self.spool.put(body, len(signals))
        self.metrics.spooled.inc(len(signals))
        self._update_gauges()

    def _update_gauges(self) -> None:
        dropped = self.spool.dropped_signals - self._dropped_seen
        if dropped:
            self.metrics.dropped.labels("spool_full").inc(dropped)
            self._dropped_seen = self.spool.dropped_signals
        self.metrics.spool_bytes.set(self.spool.size_bytes)
        self.metrics.spool_batches.set(len(self.spool))

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()
