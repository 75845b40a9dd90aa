"""What a step runner gets and returns."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from healer.agents import NodeAgents
from healer.cluster import Cluster
from healer.gang.reservations import ReservationBook
from healer.notify import Notifier
from healer.policy_file import PolicyFile
from healer.records import ActionStep, Plan, StepState
from healer.workloads import Workloads


@dataclass(frozen=True, slots=True)
class RepairRequest:
    """A request for the node agent or the platform's tooling (GPU reset, reboot, replacement)."""

    id: str
    """Stable id (the step id), so a repeated request is the same request."""
    node: str
    """Node to repair."""
    kind: str
    """``reset_gpu``, ``reboot`` or ``replace``."""
    params: Mapping[str, str] = field(default_factory=dict)
    """GPU index, PCI id, whether the GPU must be idle first."""
    state: str = "pending"
    """``pending``, ``done`` or ``failed``."""
    result: str = ""
    """What the executor of the request reported."""


class RepairRequests(Protocol):
    """Durable queue of repair requests that node agents and operators answer.

    Guarantees: ``open`` is idempotent by id (a second call returns the stored request unchanged);
    a request answered ``done`` or ``failed`` keeps that answer.
    """

    def open(self, request: RepairRequest) -> RepairRequest:
        """Store the request unless one with its id exists; return the stored one."""
        ...

    def get(self, request_id: str) -> RepairRequest | None:
        """The request, with its answer."""
        ...

    def answer(self, request_id: str, state: str, result: str) -> RepairRequest | None:
        """Answer a request (first answer wins); None when there is no such request."""
        ...


class History(Protocol):
    """What the healer did before, read from the journal (so it survives restarts)."""

    def restarts_of(self, job: str, *, exclude_plan: str) -> list[float]:
        """Times of finished restarts of this job by other plans, oldest first."""
        ...


@dataclass(frozen=True, slots=True)
class StepContext:
    """Everything a step may use; built once per executor."""

    cluster: Cluster
    """Nodes."""
    workloads: Workloads
    """Pods, owners, ConfigMaps."""
    notifier: Notifier
    """Where NOTIFY steps and repair requests go."""
    policy: PolicyFile
    """Policy (topology keys, defaults)."""
    requests: RepairRequests
    """Repair requests for the node agent."""
    history: History
    """Past restarts."""
    clock: Callable[[], float]
    """Wall clock."""
    namespace: str = "kmend-system"
    """Namespace of kmend's own objects (health-check Jobs, events)."""
    health_check_template: str = ""
    """YAML of the validation Job template ('' when none is configured)."""
    reservations: ReservationBook | None = None
    """Capacity holds read by the gang scheduler (None when it does not run)."""
    agents: NodeAgents = field(default_factory=NodeAgents)
    """Which node agents poll for requests, and what they carry out."""
    checkpoint_roots: tuple[str, ...] | None = None
    """Directories the control plane itself may search for checkpoints (every search stays under them);
    other local paths are searched by the node agent of a node running the job. None: any local path
    (the simulated cluster, tests and tools)."""


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What running a step once did."""

    state: StepState
    """SUCCEEDED, WAITING (run again later), SKIPPED or FAILED."""
    result: str
    """One line for people."""
    outputs: Mapping[str, str] = field(default_factory=dict)
    """Values later steps read (merged into the step's outputs)."""


def done(result: str, **outputs: str) -> StepOutcome:
    """The step finished."""
    return StepOutcome(StepState.SUCCEEDED, result, outputs)


def waiting(result: str, **outputs: str) -> StepOutcome:
    """The step made what progress it could; run it again later."""
    return StepOutcome(StepState.WAITING, result, outputs)


def skipped(result: str, **outputs: str) -> StepOutcome:
    """The step had nothing to do."""
    return StepOutcome(StepState.SKIPPED, result, outputs)


def failed(result: str) -> StepOutcome:
    """The step cannot succeed."""
    return StepOutcome(StepState.FAILED, result)


StepRunner = Callable[[ActionStep, Plan, StepContext], StepOutcome]
"""Runs one step once; must be idempotent (a crash may make it run again)."""


def started_at(step: ActionStep, now: float) -> float:
    """When a waiting step first ran (kept in its outputs), for its timeout."""
    return float(step.outputs.get("started_at", now))
