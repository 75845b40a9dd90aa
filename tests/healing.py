"""A healing harness for tests: a simulated world, a real SQLite store, the shipped policy, an executor."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from analyzer.pipeline import Analyzer
from analyzer.records import Incident
from analyzer.rules import Rule
from collector.signal import Signal
from healer.executor import PlanExecutor
from healer.gang.reservations import ReservationBook
from healer.lease import AlwaysLeader
from healer.notify import LogNotifier
from healer.policy import PlanContext, PolicyConfig, choose_plan
from healer.policy_file import PolicyFile, default_policy_path, parse_policy
from healer.records import Plan
from healer.safety import Guard
from healer.steps.base import StepContext
from kmend.healing import Healing
from kmend.metrics import Metrics
from kmend.store import Store
from kmend.wiring import default_health_check_template
from sim.world import JobSpec, SimWorld


class Clock:
    """A settable clock."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def incident(rules: list[Rule], signals: Iterable[Signal]) -> Incident:
    """The one incident these signals make."""
    analyzer = Analyzer(rules)
    analyzer.process(list(signals))
    [inc] = analyzer.correlator.incidents()
    return inc


def fast_policy(**defaults: object) -> PolicyFile:
    """The shipped policy with short grace periods (simulated pods end at once)."""
    import yaml

    data = yaml.safe_load(default_policy_path().read_text())
    data["defaults"].update({"drain_grace_s": 0, **defaults})
    return parse_policy(data, "test-policy")


class Harness:
    """World + store + executor, wired like the service."""

    def __init__(self, tmp: Path, *, nodes: int = 16, spares: int = 2, job_nodes: int = 0,
                 checkpoint_path: str = "", policy: PolicyFile | None = None,
                 reservations: ReservationBook | None = None) -> None:
        self.clock = Clock()
        job = JobSpec("llama", job_nodes, checkpoint_path=checkpoint_path) if job_nodes else None
        self.world = SimWorld(nodes=nodes, spares=spares, job=job, clock=self.clock)
        self.cluster, self.workloads = self.world.cluster, self.world.workloads
        self.store = Store(f"sqlite:///{tmp / 'h.db'}", clock=self.clock)
        self.store.migrate()
        self.notifier = LogNotifier()
        self.policy = policy or fast_policy()
        self.ctx = StepContext(self.cluster, self.workloads, self.notifier, self.policy, self.store.ledger,
                               self.store.ledger, self.clock, "kmend-system",
                               default_health_check_template().read_text(), reservations=reservations)
        self.sleeps: list[float] = []
        self.guard = Guard(self.store.ledger, self.policy.safety, self.cluster.list_nodes, self.clock)
        self.executor = PlanExecutor(self.ctx, self.store, guard=self.guard, sleep=self.sleeps.append)

    def healing(self) -> Healing:
        """The service's healing loop over this harness (one replica, no symptom settling)."""
        return Healing(self.store, self.ctx, self.policy, PolicyConfig(), AlwaysLeader(), Metrics(),
                       symptom_settle_s=0.0, sleep=self.sleeps.append)

    def plan(self, inc: Incident, *, namespace: str | None = "training", **config: bool) -> Plan:
        p = choose_plan(inc, self.policy, PolicyConfig(**config), PlanContext(self.clock(), namespace=namespace))
        self.store.save_plan(p)
        return p

    def run(self, plan: Plan, rounds: int = 20) -> Plan:
        """Execute until the plan stops waiting (the clock moves a second per round)."""
        for _ in range(rounds):
            plan = self.executor.execute(plan)
            if plan.state.value != "running":
                return plan
            self.clock.advance(1)
        return plan

    def answer_repairs(self) -> None:
        """The platform reports every pending repair done."""
        for n in self.cluster.list_nodes():
            for r in self.store.ledger.requests_for(n.name):
                self.store.ledger.answer(r.id, "done", "repaired")


def steps(plan: Plan) -> list[tuple[str, str]]:
    """(kind, state) of each step."""
    return [(s.kind.value, s.state.value) for s in plan.steps]


def crashed_at(plan: Plan, index: int) -> Plan:
    """The plan as journaled when the process died while step `index` was running."""
    from healer.records import PlanState, StepState

    return replace(plan, state=PlanState.RUNNING, steps=tuple(
        replace(s, state=StepState.SUCCEEDED) if i < index else
        replace(s, state=StepState.RUNNING) if i == index else s for i, s in enumerate(plan.steps)))
