"""Safety brakes checked before a step runs: circuit breaker (level and rate), hourly plan rate, one restart per
job per window.

Counts come from the journal (the ledger), not from memory, so they hold across restarts and replicas.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from healer.cluster import NodeInfo
from healer.keys import QUARANTINED_BY, QUARANTINED_LABEL
from healer.policy_file import Safety
from healer.records import DISRUPTIVE_STEPS, ActionStep, Plan, StepKind, has_disrupted

GPU_NODE_LABELS = ("nvidia.com/gpu.count", "nvidia.com/gpu.present", "nvidia.com/gpu.product")
"""Labels that mark a GPU node (set by GPU feature discovery)."""
OPERATOR_POLICY_PREFIX = "operator/"
"""Plans an operator asked for through the API: the breaker does not stop them (they still count)."""
UNLIMITED_PREFIXES = (OPERATOR_POLICY_PREFIX, "acceptance/")
"""Plans the hourly rate does not hold back (operators' and health checks of new or repaired nodes)."""


@dataclass(frozen=True, slots=True)
class BreakerState:
    """The circuit breaker as stored."""

    tripped: bool
    """While True, no automatic quarantine runs."""
    tripped_at: float | None = None
    """When it tripped."""
    reason: str = ""
    """Why it tripped, with numbers."""
    reset_at: float | None = None
    """When an operator last reset it."""
    reset_by: str = ""
    """Who reset it."""


class SafetyLedger(Protocol):
    """Durable safety state and the journal queries the brakes need.

    Guarantees: ``trip_breaker`` keeps the first trip's time and reason while tripped; counts include
    steps that are running (a crash mid-step still counts).
    """

    def breaker(self) -> BreakerState:
        """Current breaker state."""
        ...

    def trip_breaker(self, at: float, reason: str) -> BreakerState:
        """Trip it (no-op when already tripped)."""
        ...

    def reset_breaker(self, at: float, by: str) -> BreakerState:
        """Close it again."""
        ...

    def quarantined_nodes_since(self, since: float, *, exclude_plan: str) -> set[str]:
        """Nodes cordoned (or being cordoned) by plans since `since`."""
        ...

    def plans_started_since(self, since: float, *, exclude_plan: str) -> int:
        """Plans started since `since` that ran a step taking capacity or work away (``DISRUPTIVE_STEPS``)."""
        ...

    def restarts_of(self, job: str, *, exclude_plan: str) -> list[float]:
        """Times of finished restarts of this job by other plans, oldest first."""
        ...


class VerdictKind(StrEnum):
    """What the brakes say about a step."""

    ALLOW = "allow"
    WAIT = "wait"
    BLOCK = "block"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The brakes' answer."""

    kind: VerdictKind
    """Allow, wait (retry later) or block (stop the plan until an operator acts)."""
    reason: str = ""
    """Why, with numbers."""
    tripped: bool = False
    """This check tripped the breaker (announce it once)."""


ALLOW = Verdict(VerdictKind.ALLOW)
ADMITTED_S = 60.0
"""How long a cordon this guard allowed counts as a node out, labelled or not yet."""


def gpu_nodes(nodes: Sequence[NodeInfo]) -> int:
    """GPU nodes in the cluster (all nodes when none carries a GPU label)."""
    n = sum(1 for x in nodes if any(k in x.labels for k in GPU_NODE_LABELS))
    return n or len(nodes)


def out_by_kmend(nodes: Sequence[NodeInfo]) -> set[str]:
    """Nodes kmend has out of service now: quarantined by kmend (not by an operator) and not yet returned.

    A node stays labelled from its quarantine until validation returns it, so this counts nodes that went
    out days ago and are still waiting for repair, which a windowed count forgets.
    """
    return {n.name for n in nodes
            if n.labels.get(QUARANTINED_LABEL) == "true" and n.annotations.get(QUARANTINED_BY, "kmend") == "kmend"}


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%SZ")


class Guard:
    """Applies the brakes of a policy's ``safety`` section.

    With ``quarantined`` (the nodes labelled out of service, listed by label on the server), a cordon
    decision reads only those nodes fresh; the fleet's size, the denominator, is counted from a full
    list at most every ``census_s`` (the fleet changes by racks over hours, while listing ten thousand
    nodes before each cordon costs seconds).
    """

    def __init__(self, ledger: SafetyLedger, safety: Safety, nodes: Callable[[], Sequence[NodeInfo]],
                 clock: Callable[[], float], *, quarantined: Callable[[], Sequence[NodeInfo]] | None = None,
                 census_s: float = 30.0) -> None:
        self.ledger = ledger
        self.safety = safety
        self.nodes = nodes
        self.clock = clock
        self.quarantined = quarantined
        self.census_s = census_s
        self._census: tuple[float, int] | None = None
        self._admitted: dict[str, float] = {}

    def _fleet(self, now: float) -> tuple[int, set[str]]:
        """GPU nodes in the fleet, and the nodes kmend has out now.

        Out includes the nodes whose cordon this guard allowed in the last minute: a plan running beside this
        one may have cordoned its node without labelling it yet (the label follows within seconds).
        """
        self._admitted = {n: t for n, t in self._admitted.items() if now - t < ADMITTED_S}
        if self.quarantined is None:
            nodes = self.nodes()
            return gpu_nodes(nodes), out_by_kmend(nodes) | set(self._admitted)
        out = out_by_kmend(self.quarantined()) | set(self._admitted)
        if self._census is None or now - self._census[0] >= self.census_s:
            self._census = (now, gpu_nodes(self.nodes()))
        return self._census[1], out

    def budget_spent(self, now: float, *, exclude_plan: str = "") -> int | None:
        """The plans that took capacity or work away in the last hour when they fill the hourly budget, else None."""
        n = self.ledger.plans_started_since(now - 3600, exclude_plan=exclude_plan)
        return n if n >= self.safety.max_plans_per_hour else None

    def check(self, plan: Plan, step: ActionStep) -> Verdict:
        """Whether `step` of `plan` may run now."""
        now = self.clock()
        s = self.safety
        # The budget is for plans that take capacity or work away: a notification never waits for it, and a plan
        # is counted (and held) from its first such step, whatever it told people before.
        if step.kind in DISRUPTIVE_STEPS and step.node and not has_disrupted(plan.steps) \
                and not plan.policy.startswith(UNLIMITED_PREFIXES):
            n = self.budget_spent(now, exclude_plan=plan.id)
            if n is not None:
                return Verdict(VerdictKind.WAIT, f"rate limit: {n} plans acted in the last hour "
                                                 f"(max {s.max_plans_per_hour}); retried later")
        if step.kind is StepKind.CORDON and not plan.policy.startswith(OPERATOR_POLICY_PREFIX):
            breaker = self.ledger.breaker()
            if breaker.tripped:
                return Verdict(VerdictKind.BLOCK, f"circuit breaker tripped: {breaker.reason}; "
                                                  "reset it with POST /v1/breaker/reset")
            total, out = self._fleet(now)
            out |= {step.node or ""}
            # The level: nodes still out however long ago they went. One node is always allowed.
            if total and len(out) > max(1.0, s.max_out_fraction * total):
                reason = (f"quarantining {step.node} would make {len(out)} of {total} GPU nodes out of service by "
                          f"kmend (more than {s.max_out_fraction:.0%}, however long ago they went out)")
                self.ledger.trip_breaker(now, reason)
                return Verdict(VerdictKind.BLOCK, f"circuit breaker tripped: {reason}", tripped=True)
            recent = self.ledger.quarantined_nodes_since(now - s.breaker_window_s, exclude_plan=plan.id)
            recent.add(step.node or "")
            # One node is always allowed: in a small cluster 10% is less than one node.
            if total and len(recent) > max(1.0, s.breaker_max_fraction * total):
                reason = (f"quarantining {step.node} would make {len(recent)} of {total} GPU nodes quarantined "
                          f"within {s.breaker_window_s:.0f} s (more than {s.breaker_max_fraction:.0%})")
                self.ledger.trip_breaker(now, reason)
                return Verdict(VerdictKind.BLOCK, f"circuit breaker tripped: {reason}", tripped=True)
            if step.node:
                self._admitted[step.node] = now
        if step.kind is StepKind.RESTART_JOB and "old_uids" not in step.outputs and plan.job:
            last = self.ledger.restarts_of(plan.job, exclude_plan=plan.id)
            if last and now - last[-1] < s.job_restart_window_s:
                until = last[-1] + s.job_restart_window_s
                return Verdict(VerdictKind.WAIT, f"job {plan.job} was restarted at {_when(last[-1])}: one restart "
                                                 f"per {s.job_restart_window_s:.0f} s; next at {_when(until)}")
        return ALLOW
