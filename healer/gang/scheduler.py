"""The scheduling loop: snapshot, order, place each gang whole or not at all, bind through the port."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

from healer.cluster import ClusterError, NotFoundError, TemporaryError
from healer.gang.cache import SchedulerCache
from healer.gang.config import SchedulerConfig
from healer.gang.gangs import Gang
from healer.gang.metrics import CycleMetrics
from healer.gang.placement import Placement, Placer, Unfit
from healer.gang.port import (
    ConflictError,
    ObjectRef,
    PodGroupPhase,
    PodGroupStatus,
    PodScheduling,
    UncertainError,
    group_ref,
    pod_ref,
)
from healer.gang.records import PodRecord
from healer.gang.reservations import ReservationBook
from healer.gang.statement import Binding
from healer.reach import Backoff, Repeats, unreachable

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    """What a cycle did with one gang."""

    BOUND = "bound"
    UNSCHEDULABLE = "unschedulable"
    RELEASED = "released"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, slots=True)
class GangResult:
    """One gang's fate in one cycle."""

    gang: str
    """Gang key."""
    outcome: Outcome
    """What happened."""
    pods: int
    """Pods bound (BOUND) or released (RELEASED, TIMED_OUT); 0 otherwise."""
    reason: str = ""
    """Why it was not bound."""
    placement: Placement | None = None
    """The placement, when one was found."""


@dataclass(frozen=True, slots=True)
class CycleReport:
    """What one cycle did."""

    leader: bool
    """False when this replica did not hold the Lease and did nothing."""
    results: tuple[GangResult, ...] = ()
    """Per gang, in queue order."""
    seconds: float = 0.0
    """Wall time of the cycle."""

    @property
    def bound_pods(self) -> int:
        """Pods bound in this cycle."""
        return sum(r.pods for r in self.results if r.outcome == Outcome.BOUND)


class GangScheduler:
    """A secondary scheduler for gangs; acts only while ``is_leader()`` says so.

    Never leaves half a gang: if any binding of a gang fails, the pods already bound are deleted
    so that their controller recreates them, and a gang found partly bound past its timeout (after
    a crash mid-bind, or a release that failed) is released the same way.
    """

    def __init__(self, *, port: PodScheduling, is_leader: Callable[[], bool], clock: Callable[[], float],
                 config: SchedulerConfig | None = None, reservations: ReservationBook | None = None,
                 sleep: Callable[[float], None] = time.sleep, metrics: CycleMetrics | None = None) -> None:
        self.port = port
        self.is_leader = is_leader
        self.clock = clock
        self.config = config or SchedulerConfig()
        self.reservations = reservations if reservations is not None else ReservationBook()
        self.sleep = sleep
        self.metrics = metrics
        self.cache = SchedulerCache(self.config)
        """Pods, nodes and PodGroups kept between cycles; each cycle reads the changes since the last."""
        self._told: dict[str, tuple[str, float]] = {}
        self._wake = threading.Event()
        self._backoff = Backoff()
        self._repeats = Repeats()

    def notice(self, pod: PodRecord) -> None:
        """A pod changed (the port's watch saw it): a pod of ours waiting for a node starts a cycle now."""
        if not pod.node_name and not pod.terminating and pod.scheduler_name == self.config.scheduler_name:
            self._wake.set()

    def wake(self) -> None:
        """Start the next cycle now (new work, or shutting down)."""
        self._wake.set()

    def run(self, stop: threading.Event, period_s: float = 1.0, cycled: threading.Event | None = None) -> None:
        """Run a cycle when woken (``notice``, ``wake``) or every ``period_s``, until ``stop`` is set.

        A failed cycle is logged and retried. The period is the fallback for what no watch reports
        (a port without one, resources freed by a pod that finished): a gang arriving through the
        watch is placed at once, not at the next tick. ``cycled`` is set after each cycle, failed or not.
        """
        while not stop.is_set():
            woken = self._wake.is_set()
            if woken:
                # Pods of a gang arrive as a burst of watch events: one cycle for the burst, not one per pod.
                stop.wait(self.config.wake_settle_s)
            self._wake.clear()
            try:
                self.run_once(woken=woken)
            except ClusterError as exc:
                down = unreachable(exc)
                # An API server that does not answer is said once by the port (``healer.reach``); another error
                # (a 403 before RBAC is loaded, or for good) is said when it comes and when it changes. Either way
                # the next cycle waits longer while they go on, and at least what the server asked for.
                if not down and self._repeats.new(exc):
                    log.warning("gang scheduling cycle failed: %s", exc)
                asked = exc.retry_after if isinstance(exc, TemporaryError) else 0.0
                if cycled is not None:
                    cycled.set()
                self._wake.wait(self._backoff.next(max(asked, period_s if not down else 0.0)))
                continue
            except Exception:  # a bug in one cycle must not stop scheduling for good
                log.exception("gang scheduling cycle crashed")
            else:
                self._backoff.reset()
                self._repeats.cleared()
            if cycled is not None:
                cycled.set()
            self._wake.wait(period_s)

    def run_once(self, *, woken: bool = False) -> CycleReport:
        """One cycle over a fresh view of the cluster, taken from the cache after reading what changed.

        ``woken``: the port's watch reported a pending pod of ours, so the cycle reads the changes at once.
        """
        start = time.perf_counter()
        if not self.is_leader():
            return CycleReport(leader=False)
        if self.cache.config != self.config:
            self.cache = SchedulerCache(self.config)
        # With nothing pending after the last cycle, a filtered list of pending pods is the cheap
        # way to find out whether there is work; otherwise the change read itself tells. The first
        # cycle reads everything, which starts the port's watch (and with it the wake-ups).
        idle = bool(self.cache.cursor) and not self.cache.has_pending() and not woken
        if idle and not self.port.list_pending(self.config.scheduler_name):
            return self._done(CycleReport(leader=True, seconds=time.perf_counter() - start), 0)
        now = self.clock()
        self.cache.apply(self.port.changes(self.cache.cursor))
        state, gangs = self.cache.view(self.reservations.active(now))
        placer = Placer(state)
        results: list[GangResult] = []
        with ThreadPoolExecutor(max_workers=max(1, self.config.bind_workers)) as pool:
            for gang in gangs:
                if not self.is_leader():
                    break
                found = placer.place(gang)
                if isinstance(found, Placement):
                    results.append(self._bind(gang, found, pool, now))
                else:
                    results.append(self._unfit(gang, found, now))
        report = CycleReport(leader=True, results=tuple(results), seconds=time.perf_counter() - start)
        return self._done(report, sum(1 for r in results if r.outcome != Outcome.BOUND))

    def _done(self, report: CycleReport, pending: int) -> CycleReport:
        if self.metrics is not None:
            self.metrics.observe(report.seconds, pending,
                                 placed=sum(1 for r in report.results if r.outcome == Outcome.BOUND),
                                 bound=report.bound_pods)
        return report

    def _bind(self, gang: Gang, placement: Placement, pool: ThreadPoolExecutor, now: float) -> GangResult:
        abort = threading.Event()

        def one(binding: Binding) -> tuple[Binding, str]:
            """'' when bound, 'failed' when definitely not, 'uncertain' when it may have been."""
            if abort.is_set():
                return binding, "skipped"
            for attempt in range(max(1, self.config.bind_attempts)):
                try:
                    self.port.bind(binding.pod, binding.node)
                    return binding, ""
                except UncertainError as exc:
                    log.warning("binding %s/%s: %s", binding.pod.namespace, binding.pod.name, exc)
                    abort.set()
                    return binding, "uncertain"
                except TemporaryError as exc:
                    if isinstance(exc, ConflictError) or attempt + 1 >= self.config.bind_attempts:
                        log.warning("binding %s/%s: %s", binding.pod.namespace, binding.pod.name, exc)
                        abort.set()
                        return binding, "failed"
                    self.sleep(min(exc.delay, 1.0))
                except ClusterError as exc:
                    log.warning("binding %s/%s: %s", binding.pod.namespace, binding.pod.name, exc)
                    abort.set()
                    return binding, "failed"
            return binding, "failed"

        if len(placement.bindings) == 1 or self.config.bind_workers <= 1:
            outcomes = [one(b) for b in placement.bindings]
        else:
            outcomes = list(pool.map(one, placement.bindings))
        # The cache is updated here, on this thread, as kube-scheduler assumes a pod on its node
        # once bound: the next cycle must not offer a just-bound pod again or count its node as free.
        for binding, state in outcomes:
            if state == "":
                self.cache.assume_bound(binding.pod, binding.node)
        if all(state == "" for _, state in outcomes):
            self.reservations.release(gang.key)
            self._told.pop(gang.key, None)
            message = (f"bound {len(placement.bindings)} pods on {len({b.node for b in placement.bindings})} "
                       f"nodes across {placement.leaves} leaves")
            # Reported by the bind workers while the next gangs are placed and bound: the Event and the PodGroup
            # status are two writes per gang that no later gang needs to wait for (the cycle ends when they do).
            scheduled = PodGroupStatus(PodGroupPhase.SCHEDULED, len(gang.bound) + len(outcomes))
            pool.submit(self._report_quietly, gang, scheduled, "Scheduled", message, "Normal")
            return GangResult(gang.key, Outcome.BOUND, len(outcomes), placement=placement)
        failed = sum(1 for _, s in outcomes if s in ("failed", "uncertain"))
        if self.metrics is not None:
            self.metrics.failed_binds(failed)
        victims = [b.pod for b, s in outcomes if s in ("", "uncertain")]
        self._release(victims)
        why = f"binding failed for {failed} of {len(outcomes)} pods; released {len(victims)} bound pods"
        self._report(gang, PodGroupStatus(PodGroupPhase.PENDING, len(gang.bound), why), "FailedBinding", why,
                     "Warning")
        return GangResult(gang.key, Outcome.RELEASED, len(victims), why, placement)

    def _unfit(self, gang: Gang, unfit: Unfit, now: float) -> GangResult:
        partial = 0 < len(gang.bound) < gang.min_member
        if partial and now - gang.created >= gang.timeout_s:
            self._release(list(gang.bound))
            why = (f"{len(gang.bound)} of {gang.min_member} members bound after {gang.timeout_s:g}s; "
                   f"released them: {unfit.reason}")
            self._report(gang, PodGroupStatus(PodGroupPhase.PENDING, 0, why), "GangTimeout", why, "Warning")
            return GangResult(gang.key, Outcome.TIMED_OUT, len(gang.bound), why)
        # Told once per kind of reason (and again after event_repeat_s): a 256-pod gang whose pods arrive one by
        # one would otherwise get an Event and two PodGroup writes per arrival.
        kind = unfit.kind or unfit.reason
        last = self._told.get(gang.key)
        if last is None or last[0] != kind or now - last[1] >= self.config.event_repeat_s:
            self._told[gang.key] = (kind, now)
            self._report(gang, PodGroupStatus(PodGroupPhase.PENDING, len(gang.bound), unfit.reason),
                         "FailedScheduling", unfit.reason, "Warning",
                         write_status=last is None or last[0] != kind)
        return GangResult(gang.key, Outcome.UNSCHEDULABLE, 0, unfit.reason)

    def _release(self, pods: list[PodRecord]) -> None:
        for pod in pods:
            try:
                self.port.delete_pod(pod)
                self.cache.assume_deleted(pod)
            except NotFoundError:
                continue
            except ClusterError as exc:
                # The gang stays partly bound; the timeout path releases it in a later cycle.
                log.warning("releasing %s/%s: %s", pod.namespace, pod.name, exc)

    def _report_quietly(self, gang: Gang, status: PodGroupStatus, reason: str, message: str, type: str) -> None:
        """``_report`` on a worker thread, where nobody waits for its result: a bug is logged, not lost."""
        try:
            self._report(gang, status, reason, message, type)
        except Exception:
            log.exception("reporting on %s crashed", gang.key)

    def _report(self, gang: Gang, status: PodGroupStatus, reason: str, message: str, type: str,
                *, write_status: bool = True) -> None:
        pg = gang.pod_group
        ref: ObjectRef = (group_ref(pg.namespace, pg.name, pg.uid, pg.kind) if pg
                          else pod_ref(gang.pending[0]))
        try:
            self.port.emit_event(ref, reason, message, type)
            if pg is not None and write_status:
                self.port.set_pod_group_status(pg.namespace, pg.name, pg.kind, status)
        except ClusterError as exc:
            log.warning("reporting on %s: %s", gang.key, exc)
