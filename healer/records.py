"""Plan and Action: the records the healer stage produces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Mode(StrEnum):
    """How a plan may run."""

    AUTO = "auto"
    APPROVAL = "approval"
    DRY_RUN = "dry-run"


class StepKind(StrEnum):
    """What one step does through the Cluster port."""

    CORDON = "cordon"
    TAINT = "taint"
    CONDITION = "condition"
    EVENT = "event"
    NOTIFY = "notify"


class StepState(StrEnum):
    """Lifecycle of one step; the journal records each transition."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"


class PlanState(StrEnum):
    """Lifecycle of a plan."""

    PENDING = "pending"
    AWAITING_APPROVAL = "awaiting_approval"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"
    DRY_RUN = "dry_run"


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


@dataclass(frozen=True, slots=True)
class Plan:
    """The runbook chosen for one incident."""

    id: str
    """Stable id derived from the incident id (one plan per incident)."""
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
    """Why this plan (and mode) was chosen."""
