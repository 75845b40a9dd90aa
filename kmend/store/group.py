"""Group commit: batches analysed one after another are written together, each caller waiting for its own.

Ingest analyses a batch under the service lock (the correlator and detectors are shared state) and
hands its rows here; the commit happens after the lock is let go, so the next batch's decoding and
analysis overlap this one's commit. Whoever waits first while no write is under way writes
everything queued so far in one transaction, in the order it was analysed (there is no writer
thread to start or stop); the others wait for that commit. A caller answers only after its batch is
durable, so an accepted batch is never lost.

When a group fails for good (not a transient error, or one that outlasted the retries), every batch
queued until the service recovers fails with it: their analysis sits on state that was never
stored. `broken` tells the service to rebuild its state before analysing anything more, and `reset`
starts afresh once it has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from analyzer.metric_eval import SeriesState
from analyzer.records import Finding, Incident
from collector.signal import Signal


@dataclass(frozen=True, slots=True)
class WriteSet:
    """What one analysed batch (or detector evaluation, or state change) writes."""

    lines: Sequence[Signal] = ()
    """Signals stored as rows (log lines and alerts; only those behind findings with ``KMEND_STORE_LINES=evidence``)."""
    origin: tuple[str, int] | None = None
    """The numbered batch's (producer, seq), whose mark commits with its lines."""
    found: Sequence[Finding] = ()
    """New findings."""
    changed: Sequence[Incident] = ()
    """Incidents created or changed, each in its state after this batch."""
    merges: Sequence[tuple[str, str]] = ()
    """Incidents merged into another (merged id, surviving id)."""
    series: Sequence[SeriesState] = field(default=())
    """Watched metric series whose last value changed."""


@dataclass(frozen=True, slots=True)
class IngestOutcome:
    """What one ingested batch did."""

    accepted: int
    """Signals taken for the first time (log lines stored; metric and progress samples analysed, not stored)."""
    duplicates: int
    """Signals already seen (ignored)."""
    findings: tuple[Finding, ...]
    """Findings produced by the new signals."""
    incidents: tuple[Incident, ...]
    """Incidents created or changed."""
    fresh: tuple[Signal, ...] = ()
    """The newly stored signals."""


class GroupWriter:
    """Orders write sets by ticket and commits them in groups through ``write`` (which retries transient errors)."""

    def __init__(self, write: Callable[[Sequence[WriteSet]], None]) -> None:
        self._write = write
        self._cond = threading.Condition()
        self._queue: list[WriteSet] = []
        self._last = 0  # last ticket handed out
        self._done = 0  # every ticket up to here is durable (or failed, when at or below _failed_upto)
        self._failed: list[tuple[int, int, BaseException]] = []  # (first, last, error): tickets that failed
        self._writing = False
        self.broken: BaseException | None = None
        """The error that failed a group; set until the service has rebuilt its state and called `reset`."""

    @property
    def last(self) -> int:
        """The newest ticket handed out (wait for it to know everything analysed so far is durable)."""
        return self._last

    @property
    def done(self) -> int:
        """Every ticket up to this one is settled (committed or failed)."""
        return self._done

    def submit(self, ws: WriteSet) -> int:
        """Queue a write set (call in analysis order, under the lock that orders the analysis); returns its ticket."""
        with self._cond:
            self._last += 1
            if self.broken is not None:  # analysed on state that is being thrown away: it fails too
                first, _, error = self._failed[-1]
                self._failed[-1] = (first, self._last, error)
                self._done = self._last
                self._cond.notify_all()
            else:
                self._queue.append(ws)
            return self._last

    def wait(self, ticket: int) -> None:
        """Return once the ticket's write set is committed (writing the queued group when no one else is);
        raise the group's error when it failed."""
        while True:
            with self._cond:
                while True:
                    if self._done >= ticket:
                        for first, last, failure in self._failed:
                            if first <= ticket <= last:
                                raise failure
                        return
                    if not self._writing and self._queue:
                        group, self._queue = self._queue, []
                        upto = self._done + len(group)
                        self._writing = True
                        break
                    self._cond.wait()
            error: BaseException | None = None
            try:
                self._write(group)
            except BaseException as exc:  # every waiter of the group (and of later ones) gets it
                error = exc
            with self._cond:
                self._writing = False
                if error is None:
                    self._done = upto
                else:
                    self.broken = error
                    self._queue = []
                    self._failed.append((upto - len(group) + 1, self._last, error))
                    del self._failed[:-64]  # waiters of older failures have long been answered
                    self._done = self._last
                self._cond.notify_all()

    def reset(self) -> None:
        """The service has rebuilt its state from the store: later write sets are written again."""
        with self._cond:
            self.broken = None
