"""Plan and Action: the records the healer stage produces."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Mode(StrEnum):
    """How a plan may run."""

    AUTO = "auto"
    APPROVAL = "approval"
    DRY_RUN = "dry-run"


class StepKind(StrEnum):
    """What one step does through the Cluster and Workloads ports."""

    EVIDENCE = "evidence"
    CORDON = "cordon"
    TAINT = "taint"
    LABEL = "label"
    CONDITION = "condition"
    EVENT = "event"
    NOTIFY = "notify"
    DRAIN = "drain"
    SPARE_SWAP = "spare_swap"
    CHECKPOINT = "checkpoint"
    RESTART_JOB = "restart_job"
    REPAIR = "repair"
    VALIDATE = "validate"
    RETURN = "return"
    ACCEPT = "accept"
    RELEASE = "release"


class StepState(StrEnum):
    """Lifecycle of one step; the journal records each transition."""

    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    INTERRUPTED = "interrupted"  # in flight when the service was killed, in a plan an operator had decided: not rerun
    CANCELLED = "cancelled"  # waiting (on a request, a repair, a temporary error) when an operator decided the plan


class PlanState(StrEnum):
    """Lifecycle of a plan."""

    PENDING = "pending"
    AWAITING_APPROVAL = "awaiting_approval"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"
    DRY_RUN = "dry_run"
    BLOCKED = "blocked"
    CANCELLED = "cancelled"


FINAL_PLAN_STATES = frozenset({PlanState.SUCCEEDED, PlanState.FAILED, PlanState.REJECTED, PlanState.DRY_RUN,
                               PlanState.CANCELLED})
"""States a plan never leaves."""

DONE_STEP_STATES = frozenset({StepState.SUCCEEDED, StepState.SKIPPED})
"""States after which a step is never run again."""


@dataclass(frozen=True, slots=True)
class ActionStep:
    """One idempotent step of a plan."""

    id: str
    """Stable id: plan id + index, so a resumed plan finds its journal entries."""
    kind: StepKind
    """What the step does."""
    node: str | None
    """Node it acts on (None for notifications without a node)."""
    params: Mapping[str, str] = field(default_factory=dict)
    """Step arguments (taint key/value/effect, event reason/message, ...)."""
    state: StepState = StepState.PENDING
    """Where the step is."""
    result: str = ""
    """What happened, in a line (API message on failure)."""
    outputs: Mapping[str, str] = field(default_factory=dict)
    """What the step produced for later steps (chosen spare, resume point), journaled with its state."""


@dataclass(frozen=True, slots=True)
class Plan:
    """The runbook chosen for one incident."""

    id: str
    """Stable id derived from the incident id (one plan per incident); an operator's plans have their own."""
    incident_id: str
    """Incident it remediates."""
    policy: str
    """Name of the policy rule that chose it."""
    mode: Mode
    """auto, approval or dry-run."""
    steps: tuple[ActionStep, ...]
    """Steps in order."""
    state: PlanState = PlanState.PENDING
    """Where the plan is."""
    reason: str = ""
    """Why this plan (and mode) was chosen, or why it stopped."""
    node: str | None = None
    """Node at the root of the incident, if any."""
    job: str | None = None
    """Job affected, if any."""
    namespace: str | None = None
    """Namespace of the job, when known."""
    fault_class: str = ""
    """Fault class of the incident."""
    created_at: float = 0.0
    """When the plan was chosen, seconds since the epoch."""

    def outputs(self) -> dict[str, str]:
        """Outputs of every finished step merged in order (later steps read earlier ones)."""
        merged: dict[str, str] = {}
        for s in self.steps:
            merged.update(s.outputs)
        return merged


def unique_plan_id(prefix: str) -> str:
    """An id of its own for a plan no incident names (an operator's quarantine or release, a node's health check): two
    made in the same clock tick are two plans, not one saved over the other."""
    return prefix + uuid.uuid4().hex[:12]


LOCAL_STEPS = frozenset({StepKind.EVIDENCE})
"""Steps that change nothing outside the journal: run in memory and journaled with the next step's intent.

A plan whose only steps run so far are local has not started acting on the cluster (the brakes count it then)."""


DISRUPTIVE_STEPS = frozenset({StepKind.CORDON, StepKind.TAINT, StepKind.DRAIN, StepKind.SPARE_SWAP,
                              StepKind.RESTART_JOB, StepKind.REPAIR})
"""Steps that take capacity or work away (a node out, pods evicted, a job restarted, a GPU reset or a reboot): the
hourly plan budget counts plans that ran one. Telling people (notify, Events, conditions, labels) is never held
back by it: a burst of application errors must not use up the budget a lost GPU needs."""


def has_disrupted(steps: Sequence[ActionStep]) -> bool:
    """Whether a step that takes capacity or work away has run (or is running or waiting)."""
    return any(s.state not in (StepState.PENDING, StepState.SKIPPED) and s.kind in DISRUPTIVE_STEPS for s in steps)


def has_acted(steps: Sequence[ActionStep]) -> bool:
    """Whether a step that acts outside the journal has run (or is running or waiting)."""
    return any(s.state not in (StepState.PENDING, StepState.SKIPPED) and s.kind not in LOCAL_STEPS for s in steps)
