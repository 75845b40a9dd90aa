"""Several `kmend serve` replicas on one PostgreSQL: each ingests, one correlates and heals.

Every replica takes agents' batches: it decodes them, matches the rules, evaluates the metric series
and extracts progress, then commits the batch's lines, its producer mark and a digest (findings,
job placements, progress events, detector metrics) as one feed row (``kmend.store.feed``). The replica
holding the Lease folds the feed in order into its correlator, escalator and detectors, stores the
incidents with the feed cursor in one transaction, and heals. A replica that takes the Lease over
first puts back the stored incidents, then reads on from the stored cursor; plans are keyed by
incident, so the journal keeps a plan from being made twice.

Progress goes through the feed too: the hang and straggler detectors live on the leader, which sees
every replica's progress events. After a takeover they start from the next progress reports, as after
a restart.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as Tally
from collections.abc import Sequence
from typing import TYPE_CHECKING

from analyzer.detectors.flight_recorder import Dump
from analyzer.detectors.stacks import StackSample
from analyzer.digest import BatchDigest, DumpReport, StackReport
from analyzer.metric_eval import SeriesState
from analyzer.records import Finding, Incident
from collector.signal import Signal
from kmend.store import IngestOutcome
from kmend.store.feed import NOTIFY_CHANNEL, Feed, FeedRow
from kmend.store.retry import EvaluateOnce, StaleAnalysis, retrying

if TYPE_CHECKING:
    from kmend.service import Kmend

log = logging.getLogger("kmend.replicas")


class Replicas:
    """This replica's part: ``ingest`` writes the feed; ``tail`` folds it while this replica holds the Lease."""

    def __init__(self, kmend: Kmend, feed: Feed, *, identity: str, page: int = 500, prune_s: float = 60.0) -> None:
        self.kmend = kmend
        self.feed = feed
        self.identity = identity
        self.page = page
        self.prune_s = prune_s
        self.leading = False
        """Whether this replica folded the feed at its last ``tail`` (it held the Lease)."""
        self._cursor: tuple[int, int] | None = None
        self._tail_lock = threading.Lock()
        self._next_prune = 0.0
        self._listener: threading.Thread | None = None
        self._closed = threading.Event()

    # -- any replica ---------------------------------------------------------------

    def ingest(self, signals: Sequence[Signal], origin: tuple[str, int] | None = None) -> IngestOutcome:
        """Match a batch and commit it with its digest; repeated ids or a taken batch number are ignored."""
        k = self.kmend
        with k._lock, k.metrics.batch_seconds.time():
            done: list[tuple[tuple[str, ...], BatchDigest]] = []
            changed: list[SeriesState] = []

            def digest(batch: Sequence[Signal]) -> BatchDigest:
                # Once per batch: the metric series and step counters must not advance twice on a retry.
                key = tuple(s.id for s in batch)
                if not done:
                    done.append((key, k.analyzer.digest(batch)))
                elif done[0][0] != key:
                    raise StaleAnalysis("the batch changed between attempts of its transaction")
                return done[0][1]

            def series() -> list[SeriesState]:
                if not changed:
                    changed.extend(k.signals.take_changed())
                return changed

            outcome, _ = retrying(lambda: self.feed.ingest(signals, digest, series, origin, k.signals),
                                  k._retry_sleep)
        for src, n in Tally(s.source.value for s in outcome.fresh).items():
            k.metrics.signals.labels(src).inc(n)
        if outcome.duplicates:
            k.metrics.duplicates.inc(outcome.duplicates)
        for f in outcome.findings:
            k.metrics.findings.labels(f.fault_class.value).inc()
        return outcome

    def ingest_stack(self, job: str, sample: StackSample) -> None:
        """A rank's stack dump goes to the leader's stack detector through the feed."""
        k = self.kmend
        report = StackReport(job, sample, k.clock())
        retrying(lambda: self.feed.append(BatchDigest((), (), 0.0, (), (), 0.0, (report,))), k._retry_sleep)

    def ingest_dump(self, job: str, rank: int, node: str, dump: Dump, source: str) -> None:
        """A rank's checked Flight Recorder dump goes to the leader's detector through the feed."""
        k = self.kmend
        report = DumpReport(job, rank, node, dump, k.clock(), source)
        retrying(lambda: self.feed.append(BatchDigest((), (), 0.0, (), (), 0.0, dumps=(report,))), k._retry_sleep)

    # -- the Lease holder ----------------------------------------------------------------

    def tail(self) -> int:
        """While holding the Lease, fold every committed feed row after the cursor; returns rows folded."""
        k = self.kmend
        with self._tail_lock:
            with k.healing.lock:
                leads = k.healing.leader.tick()
            if not leads:
                if self.leading:
                    log.warning("lost the Lease: the feed is left to the replica that holds it")
                self.leading, self._cursor = False, None
                return 0
            if not self.leading or self._cursor is None:
                self._take_over()
            folded = 0
            while self._cursor is not None:
                rows = self.feed.read(self._cursor, self.page)
                if not rows:
                    break
                self._commit(rows)
                folded += len(rows)
                if len(rows) < self.page:
                    break
            if folded and k.clock() >= self._next_prune and self._cursor is not None:
                self._next_prune = k.clock() + self.prune_s
                self.feed.prune(self._cursor)
            return folded

    def _take_over(self) -> None:
        """Put back the incidents as the last leader stored them, then continue from its cursor."""
        k = self.kmend
        k.rebuild()
        k.healing.restored.start(inc.id for inc in k.analyzer.correlator.active())  # as at a start: paced
        k.store.reload_seq()
        self._cursor = self.feed.cursor()
        self.leading = True
        log.info("leading: folding the replica feed from %s", self._cursor)
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, name="kmend-feed-listen", daemon=True)
            self._listener.start()

    def _commit(self, rows: list[FeedRow]) -> None:
        k = self.kmend
        assert self._cursor is not None
        before, after = self._cursor, (rows[-1].tx, rows[-1].seq)
        fold = EvaluateOnce(lambda: self._fold(rows))
        with k._lock:
            try:
                outcome = retrying(lambda: k.store.record(fold, then=self.feed.advance(before, after, self.identity)),
                                   k._retry_sleep)
            except Exception:
                # The correlator holds findings that were not stored (or another replica leads now):
                # put back what the store has and take the cursor again at the next round.
                self.leading, self._cursor = False, None
                k.rebuild()
                raise
            self._cursor = after
        # Rule findings were counted by the replica that matched them; only escalations are new here.
        matched = {f.id for row in rows for f in row.digest.findings}
        for f in outcome.findings:
            if f.id not in matched:
                k.metrics.findings.labels(f.fault_class.value).inc()
        if outcome.incidents:
            k._refresh_open_gauge()
            k.wake()

    def _fold(self, rows: list[FeedRow]) -> tuple[list[Finding], list[Incident], list[tuple[str, str]]]:
        analyzer = self.kmend.analyzer
        found: list[Finding] = []
        changed: dict[str, Incident] = {}
        for row in rows:
            f, c = analyzer.fold(row.digest)
            found += f
            changed.update((i.id, i) for i in c)
        return found, list(changed.values()), analyzer.correlator.take_merges()

    def _listen(self) -> None:
        """Wake the healer loop as soon as a replica's feed row commits (PostgreSQL NOTIFY), not at its next tick."""
        import psycopg

        url = self.feed.store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not self._closed.is_set():
            try:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    while not self._closed.is_set():
                        if any(True for _ in conn.notifies(timeout=0.5)) and self.leading:
                            self.kmend.wake()
            except Exception:
                if self._closed.is_set():
                    return
                log.warning("listening for feed rows failed; the healer's tick reads them", exc_info=True)
                self._closed.wait(5.0)

    def close(self) -> None:
        """Stop listening (the process is stopping)."""
        self._closed.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
