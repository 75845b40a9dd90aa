"""What the healer reads before it plans for new incidents: the order it takes them in, and each one's context
from the cluster's watches and the journal; and how an incident follows its plan."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from analyzer.records import SEVERITY_RANK, Incident, IncidentState
from healer.cluster import NotFoundError
from healer.history import node_history
from healer.jobs import job_opted_out, jobs_bound, pods_of_job
from healer.keys import MANAGED_LABEL
from healer.policy import PlanContext, plan_id_for
from healer.policy_file import PolicyFile
from healer.records import FINAL_PLAN_STATES, Plan, PlanState, StepKind, StepState
from healer.steps.base import StepContext
from healer.workloads import PodInfo
from kmend.store import Store


def first_to_plan(inc: Incident) -> tuple[int, bool, float, str]:
    """The order new incidents are planned for: most severe first, hardware first, then oldest first."""
    return (-SEVERITY_RANK[inc.severity], not inc.hardware, inc.opened_at, inc.id)


class Restored:
    """The incidents found open at start with no plan yet: planned for after every new incident, a slice a round.

    All at once, a hundred held the process's core for a quarter of a second, thousands for seconds, and the first
    batches ingested after start waited behind them. The first slice is small; each full slice after it is twice the
    last, up to the round's bound (the rounds' own reading of every open incident is then spread over fewer of them),
    and the loop paces those rounds (``pause``).
    """

    def __init__(self, first: int, most: int) -> None:
        self.first = first
        """The first round's slice."""
        self.most = most
        """The largest slice."""
        self.ids: set[str] = set()
        """Their ids, each until it is planned for, resolved or gone."""
        self.left = 0
        """How many of them the last round left to later ones."""
        self._slice = first
        self._taken = 0

    def start(self, ids: Iterable[str]) -> None:
        """The incidents put back from the store (a start, a replica taking the Lease): the next slice is the first."""
        self.ids, self._slice = set(ids), self.first

    def order(self, new: list[Incident]) -> list[Incident]:
        """A round's new incidents in the order they are planned for (``first_to_plan``), those found open at start
        after every other: a fault arriving now is not queued behind them."""
        if self.ids:
            self.ids.intersection_update(inc.id for inc in new)
        self.left = self._taken = 0
        return sorted(new, key=lambda inc: (inc.id in self.ids, first_to_plan(inc)))

    def full(self, inc: Incident) -> bool:
        """Whether the round has taken its slice and `inc` is one of them (it waits for a later round)."""
        return self._taken >= self._slice and inc.id in self.ids

    def planned(self, inc: Incident) -> None:
        """`inc` got its plan this round."""
        if inc.id in self.ids:
            self.ids.discard(inc.id)
            self._taken += 1

    def cut(self, rest: list[Incident]) -> int:
        """The round stops before `rest`: how many of them are new (the next round starts at once for those)."""
        self.left = sum(1 for i in rest if i.id in self.ids)
        if self.left and self._taken >= self._slice:
            self._slice = min(2 * self._slice, self.most)
        return len(rest) - self.left


RESTORED_SHARE = 0.25
"""The largest share of the wall time the healer loop spends on rounds that plan for incidents found open at start."""


def pause(restored_left: int, spent_s: float, interval_s: float) -> float:
    """How long the healer loop waits for new work after a round that took `spent_s` (with what came after it): its
    period, or less while incidents found open at start wait, so that they are planned for in a steady share of the
    wall time (``RESTORED_SHARE``) rather than all at once (the ingest beside them shares the core)."""
    if restored_left <= 0:
        return interval_s
    return min(interval_s, spent_s * (1 - RESTORED_SHARE) / RESTORED_SHARE)


def plan_context(ctx: StepContext, store: Store, policy: PolicyFile, inc: Incident, now: float) -> PlanContext:
    """What the policy needs besides the incident: the node's labels and opt-out, the job the fault hurts (from the
    cluster's watches), and the node's plans (one held, a cooldown, attempts, the lemon verdict)."""
    node = inc.root_cause.node
    labels: dict[str, str] = {}
    opted_out = ""
    if node:
        try:
            # From the node watch where there is one: the cordon checks the opt-out again on the version it writes.
            info = ctx.cluster.peek_node(node)
            labels = dict(info.labels)
            if info.labels.get(MANAGED_LABEL) == "false":
                opted_out = f"node {node} has {MANAGED_LABEL}=false"
        except NotFoundError:
            pass
    job = inc.root_cause.job
    on_node: list[PodInfo] = []
    if node and inc.hardware:
        # Which job a node's fault hurts is the cluster's answer now, not what the signals once showed.
        # From the pod watch where it is in sync (a list otherwise): no request before the plan.
        on_node = [p for p in ctx.workloads.pods_on_node(node) if p.node and not p.terminating]
        bound = jobs_bound(on_node)
        job = job if job in bound else (bound[0] if len(bound) == 1 else "")
    namespace = None
    if job:
        # Job names repeat across namespaces: the incident's namespace when the evidence gave one,
        # else the one whose pod runs on the node is the one hurt.
        ns = inc.root_cause.namespace if job == inc.root_cause.job else None
        pods = pods_of_job(on_node, job, ns) or pods_of_job(ctx.workloads.list_pods(namespace=ns), job, ns)
        if pods:
            namespace = pods[0].namespace
            opted_out = opted_out or job_opted_out(ctx.workloads, pods[0].namespace, job,
                                                     [dict(p.labels) for p in pods[:1]])
        else:
            namespace = ns
    held = None
    in_cooldown = False
    history = store.list_plans(node=node) if node else []
    for p in history:
        if p.state not in FINAL_PLAN_STATES and p.id != plan_id_for(inc):
            held = p.id
        elif p.state is PlanState.SUCCEEDED and now - p.created_at < policy.safety.node_cooldown_s \
                and any(s.kind is StepKind.CORDON for s in p.steps):
            in_cooldown = True
    attempts, lemon = node_history(history, policy.safety, now, inc.root_cause.gpu or inc.root_cause.pci)
    return PlanContext(now, labels, namespace, opted_out, held, in_cooldown, job=job, attempts=attempts,
                       lemon=lemon)


def settle(done: Plan, set_state: Callable[[str, IncidentState, str], None]) -> Plan:
    """The incident follows its plan: remediating once the node is quarantined, resolved once it is back."""
    if done.incident_id:
        quarantined = any(s.kind is StepKind.EVENT and s.state is StepState.SUCCEEDED for s in done.steps)
        if done.state is PlanState.SUCCEEDED and any(s.node for s in done.steps if s.kind is StepKind.RETURN):
            set_state(done.incident_id, IncidentState.RESOLVED, f"plan {done.id} returned {done.node} to the pool")
        elif quarantined:
            set_state(done.incident_id, IncidentState.REMEDIATING, f"node {done.node} quarantined by {done.id}")
    return done
