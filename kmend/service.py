"""The service core: ingest → analyze → store, and the healer loop. Wires the stages."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from analyzer.correlate import Correlator
from analyzer.detectors.flight_recorder import load_dump
from analyzer.detectors.hang import HangConfig
from analyzer.detectors.stacks import StackSample
from analyzer.detectors.straggler import StragglerConfig
from analyzer.detectors.suite import DetectorSuite
from analyzer.metric_eval import SeriesState, SignalEvaluator
from analyzer.metric_rules import SignalRules
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import ProgressRule
from analyzer.records import Finding, Incident, IncidentState, job_location
from analyzer.rules import Rule
from collector.podmeta import JOB_LABELS
from collector.signal import Signal
from healer.cluster import Cluster
from healer.gang.scheduler import GangScheduler
from healer.lease import AlwaysLeader
from healer.notify import Notifier
from healer.policy import PolicyConfig
from healer.policy_file import PolicyFile, load_policy
from healer.reach import Backoff, Reachability, Repeats, outage_wait, report
from healer.records import Plan, PlanState
from healer.steps.base import RepairRequest, StepContext
from healer.workloads import Workloads
from kmend import views
from kmend.grouped import GroupedIngest, report_failures
from kmend.healer_config import HealerConfig
from kmend.healing import Healing, Leader
from kmend.metrics import Metrics
from kmend.planning import pause
from kmend.store import IngestOutcome, Store
from kmend.store.group import WriteSet
from kmend.store.retry import AnalyseOnce, EvaluateOnce, retrying

if TYPE_CHECKING:
    from kmend.replicas import Replicas

_SOURCE = attrgetter("source")

log = logging.getLogger("kmend.service")

class Kmend:
    """Ingests signals, keeps incidents, runs plans. Thread-safe."""

    def __init__(
        self,
        store: Store,
        cluster: Cluster,
        rules: Sequence[Rule],
        notifier: Notifier,
        *,
        workloads: Workloads,
        policy: PolicyFile | None = None,
        leader: Leader | None = None,
        metrics: Metrics | None = None,
        healer: HealerConfig | None = None,
        correlation_window_s: float = 1200.0,
        clock: Callable[[], float] = time.time,
        health_check_template: str = "",
        namespace: str = "kmend-system",
        sleep: Callable[[float], None] | None = None,
        scheduler: GangScheduler | None = None,
        progress_rules: Sequence[ProgressRule] = (),
        hang: HangConfig | None = None,
        straggler: StragglerConfig | None = None,
        flight_recorder_settle_s: float = 10.0,
        checkpoint_roots: Sequence[str] | None = None,
        signal_rules: SignalRules | None = None,
    ) -> None:
        self.store = store
        self.cluster = cluster
        self.workloads = workloads
        self.rules = tuple(rules)
        self.metrics = metrics or Metrics()
        self.healer = healer or HealerConfig(PolicyConfig())
        self.clock = clock
        self.window_s = correlation_window_s
        self.scheduler = scheduler
        self.reach: Reachability | None = getattr(cluster, "reach", None)  # the real API server, as adapters see it
        self._round_backoff, self._repeats = Backoff(), {"round": Repeats(), "gauges": Repeats()}
        if self.reach is not None:
            self.reach.on_return.append(self.wake)  # a round backing off starts again as soon as the server answers
        self.detectors = DetectorSuite(progress_rules, hang=hang, straggler=straggler,
                                       flight_recorder_settle_s=flight_recorder_settle_s)
        self.signals = SignalEvaluator(signal_rules or SignalRules(), xid_rules=self.rules)
        self.analyzer = Analyzer(self.rules, correlator=Correlator(window_s=correlation_window_s),
                                 detectors=self.detectors, signals=self.signals)
        self._watermark = (0.0, 0.0)
        self._evidence_asked: set[str] = set()
        self._pods_checked: dict[str, float] = {}
        self._next_evaluation = 0.0
        self._next_gauges = 0.0
        ctx = StepContext(cluster, workloads, notifier, policy or load_policy(), store.ledger, store.ledger, clock,
                          namespace, health_check_template,
                          reservations=scheduler.reservations if scheduler else None,
                          checkpoint_roots=None if checkpoint_roots is None else tuple(checkpoint_roots))
        self.healing = Healing(store, ctx, ctx.policy, self.healer.policy, leader or AlwaysLeader(), self.metrics,
                               symptom_settle_s=self.healer.symptom_settle_s, sleep=sleep,
                               resume_s=self.healer.resume_s)
        self._lock = threading.RLock()
        self._retry_sleep = sleep or time.sleep
        self.grouped = GroupedIngest(self)
        """Numbered batches, detector findings and state changes: committed after the lock (group commit)."""
        self._wake = threading.Event()
        self.healing.background.on_done = self._wake.set  # a finished step is settled at once, not at the next tick
        self.ready = False
        self.on_start: list[Callable[[], None]] = []
        """Called once the store is migrated and the state rebuilt (what happened before the store existed)."""
        self.replicas: Replicas | None = None
        """Set when several replicas share PostgreSQL: ingest writes the feed, the Lease holder correlates."""

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Migrate the schema and rebuild in-memory state from the store."""
        self.store.migrate()
        # Counters go on from their last stored sample: an increase across the restart is found, and
        # a counter that did not move is not an increase from zero.
        self.signals.restore(self.store.metric_series())
        self.rebuild()
        self.healing.restored.start(inc.id for inc in self.analyzer.correlator.active())  # planned for in a paced turn
        for started in self.on_start:
            started()
        self.ready = True

    def rebuild(self) -> None:
        """Put back the stored live incidents as they were (ids, members, state), without re-correlating.

        Finished incidents quiet for longer than the correlator keeps them stay in the store only.
        """
        with self._lock:
            corr = Correlator(window_s=self.window_s)
            for stored in self.store.live_incidents(keep_s=3 * self.window_s):
                corr.restore(stored)
            states = self.store.incident_states()
            now = self.clock()
            for inc in corr.incidents():
                st = states.get(inc.id)
                if st and st != inc.state.value:
                    corr.set_state(inc.id, IncidentState(st), now, "restored")
            # The detectors keep their state: a rolled-back batch comes again and is folded idempotently.
            # The compiled matcher is kept: it holds no incident state, and compiling it again costs seconds.
            self.analyzer = Analyzer(self.rules, correlator=corr, detectors=self.detectors, signals=self.signals,
                                     matcher=self.analyzer.matcher)
            self.grouped.claims.clear()  # the stored marks are the truth again
            self._refresh_open_gauge()

    # -- ingest --------------------------------------------------------------------

    def ingest(self, signals: Sequence[Signal], origin: tuple[str, int] | None = None) -> IngestOutcome:
        """Store and analyze a batch; repeated ids, or a numbered batch already taken (`origin`), are ignored."""
        if self.replicas is not None:
            return self.replicas.ingest(signals, origin)
        if origin is not None:  # analysed under the lock, committed after it in a group with its neighbours
            with self.metrics.batch_seconds.time():
                outcome = self.grouped.ingest(signals, origin)
            self._count(outcome)
            return outcome
        with self.grouped.turnstile.turn(), self._lock, self.metrics.batch_seconds.time():
            self.grouped.flush()  # results written here are not overtaken by queued ones
            analyse = AnalyseOnce(self._analyze)  # a retried transaction reuses this analysis
            changed: list[SeriesState] = []

            def series() -> list[SeriesState]:
                # Taken once per batch: a retried transaction writes the same states again.
                if not changed:
                    changed.extend(self.signals.take_changed())
                return changed

            try:
                outcome = retrying(lambda: self.store.ingest(signals, analyse, series), self._retry_sleep)
            except Exception:
                # Not transient, or still failing: the correlator may hold findings never stored: rebuild it.
                self.rebuild()
                raise
        self._count(outcome)
        return outcome

    def replayed(self, origin: tuple[str, int], sent: int) -> IngestOutcome | None:
        """The answer to a numbered batch at or below its producer's last number (one lookup, no lock, nothing
        decoded or analysed), or None when the batch is new and must be ingested.

        Marks only rise, so a mark read here that is already stale can only send a replay down the full
        path, where the transaction looks again.
        """
        last = self.store.producer_seq(origin[0])
        if last is None or origin[1] > last:
            return None
        self.metrics.duplicates.inc(sent)
        return IngestOutcome(0, sent, (), ())

    def _count(self, outcome: IngestOutcome) -> None:
        # Counted by source member in C, its value read once per source (not once per signal).
        for src, n in Tally(map(_SOURCE, outcome.fresh)).items():
            self.metrics.signals.labels(src.value).inc(n)
        if outcome.duplicates:
            self.metrics.duplicates.inc(outcome.duplicates)
        for f in outcome.findings:
            self.metrics.findings.labels(f.fault_class.value).inc()
        if outcome.incidents:
            self._refresh_open_gauge()
            self._wake.set()

    # -- detectors ---------------------------------------------------------------

    def detector_now(self) -> float:
        """The detectors' "now": signal time advanced by the wall time since it was last seen.

        Live, this is the clock. For replayed or back-dated signals it is their own
        timeline, so an hour-old trace does not look like an hour-long stall; it never
        runs ahead of the clock.
        """
        wall = self.clock()
        mark = self.detectors.watermark
        seen, at = self._watermark
        if mark > seen:
            self._watermark = (mark, wall)
            seen, at = mark, wall
        if seen <= 0:
            return wall
        return min(wall, seen + (wall - at))

    def evaluate(self, now: float | None = None) -> IngestOutcome:
        """Run the detectors once and store their findings (the healer loop calls this periodically).

        Settled Flight Recorder dumps are judged between two short holds of the lock, so
        analysing a large dump never holds up ingest.
        """
        if self.replicas is not None and not self.replicas.leading:
            return IngestOutcome(0, 0, (), ())  # the detectors run on the replica that folds the feed
        with self._lock:
            t = self.detector_now() if now is None else now
            settled = self.detectors.take_settled_dumps(t)
        judged = self.detectors.judge_dumps(settled) if settled else []
        if self.replicas is None:
            outcome, failures = self.grouped.evaluate(t, judged)
            report_failures(failures, self.metrics)
            self._count(outcome)
            return outcome
        with self._lock:
            evaluate = EvaluateOnce(lambda: self._evaluate(t, judged))
            try:
                outcome = retrying(lambda: self.store.record(evaluate), self._retry_sleep)
            except Exception:
                self.rebuild()
                raise
            self._request_evidence(t)
            failures = self.detectors.take_failures()
        report_failures(failures, self.metrics)
        self._count(outcome)
        return outcome

    def ingest_stack(self, job: str, rank: int, node: str, pid: int, text: str, state: str = "",
                     cpu_s: float | None = None) -> None:
        """Accept one training process's Python stack, captured by the node agent on a suspected hang."""
        if self.replicas is not None:
            self.replicas.ingest_stack(job, StackSample(rank=rank, node=node, pid=pid, text=text, state=state,
                                                        cpu_s=cpu_s,
                                                        source=f"{node}/stack/{job}/{rank}/{pid}/{self.clock():.3f}"))
            return
        with self._lock:
            t = self.detector_now()
            self.detectors.add_stack(job, StackSample(rank=rank, node=node, pid=pid, text=text, state=state,
                                                      cpu_s=cpu_s, source=f"{node}/stack/{job}/{rank}/{pid}/{t:.3f}"),
                                     t)
        self._wake.set()

    def _request_evidence(self, now: float, suspects: list[tuple[str, list[str], float]] | None = None) -> None:
        # A stalled job: ask its nodes' agents for every rank's Python stack (and a Flight Recorder dump) while it is
        # stuck, before the hang is called or a plan restarts it. One request per node and stall, one more every
        # half threshold while the stacks hold the finding. Given `suspects`, it runs outside the lock.
        current: set[str] = set()
        asks: list[RepairRequest] = []
        suspects = self.detectors.suspects(now) if suspects is None else suspects
        for job, nodes, since in suspects:
            if self._pods_finished(job):
                with self._lock:
                    self.detectors.end_job(job, now)
                continue
            with self._lock:  # the detectors' state, read while batches change it
                again = self.detectors.evidence_round(job, now)
            # A newer look while stacks that showed the ranks busy hold the hang gets its own request.
            look = f":{again}" if again else ""
            for node in nodes:
                # The id goes in a URL path (the agent answers POST .../requests/{id}): no "/" from ``namespace/job``.
                rid = f"stack-dump:{job.replace('/', ':')}:{since:.3f}:{node}{look}"
                current.add(rid)
                if rid not in self._evidence_asked:
                    asks.append(RepairRequest(id=rid, node=node, kind="stack_dump", params={"job": job}))
        # One transaction for them all: a stalled 1,000-node job's requests take the write queue once, not once each.
        self.store.ledger.open_all(asks)
        # Only stalls still under way are remembered (the ledger keeps the requests themselves).
        self._evidence_asked = current
        jobs = {job for job, _, _ in suspects}
        self._pods_checked = {j: t for j, t in self._pods_checked.items() if j in jobs}

    def _pods_finished(self, job: str) -> bool:
        """Whether the API shows every pod of the job Succeeded, Failed or being deleted (asked at most every 5 s)."""
        wall = self.clock()
        if self._pods_checked.get(job, 0.0) > wall:
            return False
        self._pods_checked[job] = wall + 5.0
        for key, _ in JOB_LABELS:
            try:
                where = job_location(job)  # the detectors' key: ``namespace/job`` or a bare name
                pods = self.workloads.list_pods(namespace=where.namespace, selector={key: where.job or job})
            except Exception:
                log.debug("pods of %s unavailable; the job's logs decide", job, exc_info=True)
                return False
            if pods:
                return all(p.phase in ("Succeeded", "Failed") or p.terminating for p in pods)
        return False

    def ingest_flight_recorder(self, job: str, rank: int, node: str, data: bytes, *, source: str = "") -> None:
        """Accept one rank's PyTorch Flight Recorder dump (raises DumpError when it cannot be read safely)."""
        dump = load_dump(data)  # parsed and checked before the lock: a large dump never blocks ingest
        if self.replicas is not None:
            self.replicas.ingest_dump(job, rank, node, dump, source or f"{node}/flight-recorder/{job}/{rank}")
            return
        with self._lock:
            self.detectors.add_checked_dump(job, rank, node, dump, self.detector_now(),
                                            source=source or f"{node}/flight-recorder/{job}/{rank}")
        self._wake.set()

    def _analyze(self, signals: Sequence[Signal]) -> tuple[list[Finding], list[Incident], list[tuple[str, str]]]:
        found, changed = self.analyzer.process(signals)
        return found, changed, self.analyzer.correlator.take_merges()

    def _evaluate(self, now: float, judged: Sequence[Finding] = ()
                  ) -> tuple[list[Finding], list[Incident], list[tuple[str, str]]]:
        found, changed = self.analyzer.evaluate(now, judged)
        return found, changed + self._resolve_quiet(now), self.analyzer.correlator.take_merges()

    def _resolve_quiet(self, now: float) -> list[Incident]:
        """Open incidents quiet for `quiet_resolve_s` resolve, unless a plan for them is unfinished.

        Judged on the signals' timeline (`now` is the detectors' now), and only once a signal has
        arrived since start: restored incidents are not judged by a clock their senders never shared.
        Without it, notify-only incidents stayed open for ever, each one more for the correlator and
        the healer to look at.
        """
        quiet_s = self.healer.quiet_resolve_s
        corr = self.analyzer.correlator
        if quiet_s <= 0 or self.detectors.watermark <= 0 or not corr.quiet(now - quiet_s):
            return []
        keep = self.store.incidents_with_unfinished_plans()
        return corr.resolve_quiet(now - quiet_s, self.clock(), keep=keep, quiet_s=quiet_s)

    def _follows(self) -> bool:
        """Whether this is a replica that does not fold the feed: its correlator is as of its start, so what it
        shows about incidents comes from PostgreSQL, where the Lease holder stores them as it folds."""
        return self.replicas is not None and not self.replicas.leading

    def incidents(self) -> list[Incident]:
        """All incidents, oldest first (the stored live ones on a replica that does not lead)."""
        if self._follows():
            return sorted(self.store.live_incidents(keep_s=3 * self.window_s), key=lambda i: (i.opened_at, i.id))
        with self._lock:
            return self.analyzer.correlator.incidents()

    # -- healing ---------------------------------------------------------------------

    def heal_once(self, *, interrupted: Callable[[], bool] = lambda: False, detach: bool = False) -> list[Plan]:
        """Plan for new incidents and run runnable plans; returns the plans touched.

        ``interrupted`` tells the round that new work has come: it stops resuming older plans. ``detach`` (the
        loop): new plans' quarantines go on in the background after their cordons (``Healing.heal_once``).
        """
        with self._lock:
            incidents = self.analyzer.correlator.active()
            ticket = self.grouped.writer.last
        self.grouped.durable(ticket)  # act only on stored incidents: no action survives a crash that lost its cause
        return self.healing.heal_once(incidents, self.set_incident_state, interrupted=interrupted, detach=detach)

    def set_incident_state(self, incident_id: str, state: IncidentState, why: str) -> None:
        """Move an incident along (remediating, resolved) and store it, in order with the batches' writes."""
        with self._lock:
            current = self.analyzer.correlator.get(incident_id)
            if current is None or current.id != incident_id or current.state == state:
                return
            updated = self.analyzer.correlator.set_state(incident_id, state, self.clock(), why)
            ticket = self.grouped.writer.submit(WriteSet(changed=(updated,))) if self.replicas is None else 0
        if ticket:
            self.grouped.durable(ticket)
        else:
            self.store.save_incident(updated)
        self._refresh_open_gauge()

    def wake(self) -> None:
        """Make the healer loop run now."""
        self._wake.set()

    def run_healer(self, stop: threading.Event) -> None:
        """Healer loop: runs until `stop` is set; a failing round is logged, never fatal."""
        while not stop.is_set():
            # Cleared before the round reads incidents: a wake during the round starts the next one at once,
            # and tells this one to leave older plans for later.
            self._wake.clear()
            try:
                if self.replicas is not None:
                    self.replicas.tail()
            except Exception:
                log.exception("reading the replica feed failed")
            more = False  # new incidents left to the next round: it starts at once (not after a failed round)
            began = time.monotonic()
            try:
                self.heal_once(interrupted=self._wake.is_set, detach=True)
                self.metrics.healer_round.set_to_current_time()
                more = self.healing.backlog > 0
            except Exception as exc:  # an API server that does not answer is said once, whichever loop meets it
                report(exc, "healer round failed", self.reach, self._repeats["round"], log)
            # After the round, not before it: a due evaluation of every job's detectors must not sit between an
            # ingested Xid and its cordon. What it finds wakes the next round at once.
            try:
                if self.clock() >= self._next_evaluation:
                    self._next_evaluation = self.clock() + self.healer.detector_interval_s
                    self.evaluate()
            except Exception:
                log.exception("detector evaluation failed")
            if self.clock() >= self._next_gauges:
                self._next_gauges = self.clock() + 10.0
                try:
                    self.refresh_gauges()
                except Exception as exc:
                    report(exc, "metrics refresh failed", self.reach, self._repeats["gauges"], log)
            if (outage := outage_wait(self.reach, self._round_backoff)) is not None:
                self._wake.wait(outage)  # nothing a round does reaches the cluster: wait longer each time
                continue
            if not more:
                self._wake.wait(pause(self.healing.restored.left, time.monotonic() - began, self.healer.interval_s))

    # -- views -------------------------------------------------------------------------

    def node_health(self) -> dict[str, dict[str, Any]]:
        """Per-node health (``kmend.views.node_health``); sets the quarantined-nodes gauge.

        Any replica answers with the leader's current view: one that does not lead reads the open incidents
        from PostgreSQL (one indexed query), not from its own correlator.
        """
        if self._follows():
            assert self.replicas is not None
            by_node = self.replicas.feed.open_incidents_by_node()
        else:
            with self._lock:
                active = self.analyzer.correlator.active()
            by_node = views.open_by_node(active)
        out = views.node_health(self.cluster.list_nodes(), by_node, self.healing.node_records())
        self.metrics.nodes_quarantined.set(sum(1 for v in out.values() if v["fault"] is not None))
        return out

    def actions(self) -> list[dict[str, Any]]:
        """Every step of every plan, flattened (for summaries)."""
        return views.actions(self.store.list_plans())

    def refresh_gauges(self) -> None:
        """Gauges that alerts read, kept fresh by the healer loop rather than by someone asking the API."""
        self.metrics.set_counts(self.metrics.plans_by_state, self.store.plan_counts(), (s.value for s in PlanState))
        self.node_health()  # sets kmend_nodes_quarantined
        if self._follows():
            self._refresh_open_gauge()

    def _refresh_open_gauge(self) -> None:
        # A replica that does not fold the feed counts what the Lease holder stored, not its own stale view.
        counts = self.replicas.feed.open_incident_counts() if self.replicas and self._follows() else {
            fc.value: n for fc, n in self.analyzer.correlator.active_counts().items()}
        self.metrics.set_counts(self.metrics.incidents_open, counts)

