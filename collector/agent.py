"""The agent's poll loop: sources in, batches out, checkpoints only after delivery."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from collector.checkpoint import CheckpointStore
from collector.metrics import AgentMetrics
from collector.shipper import Shipper
from collector.signal import Signal
from collector.sources.base import Clock, SignalSource

log = logging.getLogger(__name__)


class Agent:
    """Polls every source, ships in batches, then checkpoints what was delivered.

    A cursor is saved only after every signal read before it was shipped or
    spooled, so a crash at any point re-reads (and the service drops the
    repeats by id) rather than skips. One source failing never stops the
    others: its exception is counted and the loop goes on.
    """

    def __init__(
        self,
        *,
        sources: Sequence[SignalSource],
        shipper: Shipper,
        checkpoints: CheckpointStore,
        metrics: AgentMetrics,
        batch_size: int = 1000,
        flush_interval: float = 1.0,
        poll_interval: float = 0.5,
        max_pending: int = 20000,
        clock: Clock = time.monotonic,
    ) -> None:
        self.sources = list(sources)
        self.shipper = shipper
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.poll_interval = poll_interval
        self.max_pending = max_pending
        self.clock = clock
        self._pending: list[Signal] = []
        self._cursors: dict[str, dict[str, Any]] = {}
        self._last_flush = clock()
        self._last_loop = clock()
        self._errors_logged: dict[str, float] = {}

    def run_once(self) -> None:
        """One pass over all sources; flushes when a batch is full or due."""
        for src in self.sources:
            if len(self._pending) >= self.max_pending:
                # Backpressure: unread data stays in files, which is safer than in memory.
                break
            try:
                polled = src.poll()
            except Exception:
                self.metrics.source_errors.labels(src.name).inc()
                self._log_error(src.name)
                continue
            if polled.lines:
                self.metrics.lines_read.labels(src.name).inc(polled.lines)
            if polled.filtered:
                self.metrics.lines_filtered.labels(src.name).inc(polled.filtered)
            if polled.errors:
                self.metrics.source_errors.labels(src.name).inc(polled.errors)
            if polled.lost:
                self.metrics.source_lost.labels(src.name).inc(polled.lost)
            if polled.signals:
                self.metrics.signals_read.labels(src.name).inc(len(polled.signals))
                self._pending.extend(polled.signals)
            if polled.cursors:
                self._cursors.setdefault(src.name, {}).update(polled.cursors)
            if len(self._pending) >= self.batch_size:
                self.flush()
        if self.clock() - self._last_flush >= self.flush_interval:
            self.flush()
        self._last_loop = self.clock()
        self.metrics.last_loop.set_to_current_time()

    def _log_error(self, name: str) -> None:
        now = self.clock()
        # One traceback per source per minute: a broken source must not flood the node's logs.
        if now - self._errors_logged.get(name, -1e9) >= 60.0:
            self._errors_logged[name] = now
            log.exception("source %s failed; other sources continue", name)

    def flush(self) -> None:
        """Deliver everything pending, then persist the cursors it completes."""
        self._last_flush = self.clock()
        if not self._pending:
            # Nothing new: still the moment to drain the spool once the service is back.
            self.shipper.replay()
        kept: list[Signal] = []
        while self._pending:
            batch = self._pending[: self.batch_size]
            kept.extend(self.shipper.deliver(batch))
            del self._pending[: len(batch)]
        if kept:
            # The spool is full of lines worth as much: hold these and read no further. Cursors are not
            # saved, so after a restart the lines are read again from the files.
            self._pending = kept
            self.metrics.backpressure.inc()
            return
        if not self._cursors:
            return
        for name, cursors in self._cursors.items():
            self.checkpoints.update(name, cursors)
        self._cursors = {}
        self.checkpoints.save()

    def healthy(self, now: float | None = None) -> bool:
        """The loop completed recently (it is not stuck)."""
        t = self.clock() if now is None else now
        return t - self._last_loop < max(30.0, 10 * self.poll_interval)

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop`` is set; flush and close sources on the way out."""
        try:
            while not stop.is_set():
                started = self.clock()
                try:
                    self.run_once()
                except Exception:
                    # Delivery failed (e.g. spool disk full): keep the batch and retry.
                    self._log_error("shipper")
                stop.wait(max(0.0, self.poll_interval - (self.clock() - started)))
        finally:
            try:
                self.flush()
            except Exception:
                log.exception("final flush failed; unsent lines are re-read from the checkpoint")
            for src in self.sources:
                try:
                    src.close()
                except Exception:
                    log.exception("closing source %s", src.name)
            self.shipper.close()
