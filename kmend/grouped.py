"""Numbered batches and detector findings: analysed under the service lock, committed after it in groups.

The lock covers only what mutates shared state (the correlator, the detectors, the metric series); the
batch's decoding comes before it and its rows and commit after it, so batch N's commit overlaps batch
N+1's analysis. Each caller answers only once its own batch is durable (`GroupWriter`), and the
producer's mark commits with the batch: an accepted batch is never lost and a replay is never taken twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from analyzer.detectors.suite import DetectorFailure
from analyzer.records import Finding
from collector.signal import Signal
from kmend.metrics import Metrics
from kmend.store import IngestOutcome
from kmend.store.group import GroupWriter, WriteSet
from kmend.store.retry import retrying
from kmend.store.rows import kept
from kmend.turnstile import Turnstile

if TYPE_CHECKING:
    from kmend.service import Kmend

_ID = attrgetter("id")
MAX_CLAIMS = 100_000
"""Producers whose marks are kept in memory; past it, those already stored are read from the store again when seen."""

log = logging.getLogger("kmend.service")


def report_failures(failures: Sequence[DetectorFailure], metrics: Metrics) -> None:
    """Log and count the detectors that failed in an evaluation (the others went on)."""
    for fail in failures:
        log.error("detector %s failed%s: %s (the other detectors went on)", fail.detector,
                  f" on job {fail.job}" if fail.job else "", fail.error)
        metrics.detector_errors.labels(fail.detector).inc()


class GroupedIngest:
    """The service's group-committed writes: numbered batches, detector findings and incident state changes."""

    def __init__(self, kmend: Kmend) -> None:
        self.kmend = kmend
        store = kmend.store
        self.writer = GroupWriter(lambda group: retrying(lambda: store.write(group), kmend._retry_sleep))
        """Orders and commits the write sets."""
        self.claims: dict[str, tuple[int, int]] = {}
        """Per producer, the last batch number analysed here and its write ticket (a replay in flight waits on it)."""
        self.turnstile = Turnstile()
        """Orders the batches' analysis first come, first served; tells how long a new batch would wait."""

    def recover(self) -> None:
        """After a failed group commit (call under the lock): rebuild from the store, then write again."""
        if self.writer.broken is not None:
            self.kmend.rebuild()
            self.writer.reset()

    def flush(self) -> None:
        """Under the lock: wait until everything analysed so far is committed (before writing outside the group)."""
        self.recover()
        self.durable(self.writer.last)

    def durable(self, ticket: int) -> None:
        """Wait until everything up to `ticket` is committed; a failed commit rebuilds the state, then raises."""
        try:
            self.writer.wait(ticket)
        except Exception:
            with self.kmend._lock:
                self.recover()
            raise

    def ingest(self, signals: Sequence[Signal], origin: tuple[str, int]) -> IngestOutcome:
        """A numbered batch: analysed under the lock, committed after it with its neighbours.

        A replay, even of a batch whose commit is still under way, is answered once that batch is durable.
        """
        k = self.kmend
        unique: Sequence[Signal] = signals
        if len(set(map(_ID, signals))) < len(signals):  # a repeated id is taken once (its first copy)
            first: dict[str, Signal] = {}
            for s in signals:
                first.setdefault(s.id, s)
            unique = list(first.values())
        producer, seq = origin
        with self.turnstile.turn(), k._lock:  # batches in arrival order: none waits behind later ones
            self.recover()
            claim = self.claims.get(producer)
            if claim is None:
                mark = k.store.producer_seq(producer)
                claim = (0 if mark is None else mark, 0)
            if seq <= claim[0]:
                ticket, fresh = claim[1], None
            else:
                found, changed, merges = k._analyze(unique) if unique else ([], [], [])
                series = k.signals.take_changed() if unique else []
                ticket = self.writer.submit(WriteSet(self._rows(unique, found), origin, found, changed, merges, series))
                self.claims[producer] = (seq, ticket)
                if len(self.claims) > MAX_CLAIMS:  # producers come and go (an agent restarts under a new id)
                    self.claims = {p: c for p, c in self.claims.items() if c[1] > self.writer.done}
                fresh = (found, changed)
        self.durable(ticket)
        if fresh is None:
            return IngestOutcome(0, len(signals), (), ())
        return IngestOutcome(len(unique), len(signals) - len(unique), tuple(fresh[0]), tuple(fresh[1]), tuple(unique))

    def _rows(self, fresh: Sequence[Signal], found: Sequence[Finding]) -> list[Signal]:
        """The signals stored as rows: log lines and alerts (with ``evidence``, only those a finding names)."""
        rows = [s for s in fresh if kept(s)]
        if self.kmend.store.lines != "evidence":
            return rows
        evidence = {e for f in found for e in f.evidence}
        return [s for s in rows if s.id in evidence]

    def evaluate(self, now: float, judged: Sequence[Finding]) -> tuple[IngestOutcome, list[DetectorFailure]]:
        """The detectors' findings at `now`, written in order with the batches; and the detectors that failed."""
        k = self.kmend
        with k._lock:
            self.recover()
            found, changed, merges = k._evaluate(now, judged)
            ticket = self.writer.submit(WriteSet(found=found, changed=changed, merges=merges))
            suspects = k.detectors.suspects(now)
            failures = k.detectors.take_failures()
        self.durable(ticket)
        k._request_evidence(now, suspects)  # the pod lookups and the requests' writes: outside the lock
        return IngestOutcome(0, 0, tuple(found), tuple(changed)), failures
