"""The healing policy file: YAML validated at load (file and field in every error), frozen records inside.

The shipped default is ``healer/policies/default.yaml``; deployments point ``KMEND_POLICY_FILE`` at
their own. Rules are tried in order and the first that matches an incident names its plan and mode.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from analyzer.records import SEVERITY_RANK, Action, FaultClass, Severity
from healer.records import Mode


class StepName(StrEnum):
    """Steps a plan template may list, in the order they make sense."""

    QUARANTINE = "quarantine"
    DRAIN = "drain"
    SPARE_SWAP = "spare_swap"
    CHECKPOINT = "checkpoint"
    RESTART_JOB = "restart_job"
    REPAIR = "repair"
    VALIDATE = "validate"
    RETURN = "return"
    NOTIFY = "notify"


class RepairKind(StrEnum):
    """What the repair step asks for."""

    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    REPLACE = "replace"


class DrainScope(StrEnum):
    """Whose pods a drain evicts from the quarantined node."""

    NODE = "node"
    """The affected job's pods (every pod but DaemonSets' when no job is known)."""
    GPU = "gpu"
    """When the incident names one GPU: only the pods holding it (or whose GPUs are unknown); pods on the
    node's healthy GPUs keep running while the node stays cordoned."""


class Escalation(StrEnum):
    """Restart levels, least to most disruptive (Volcano's policies)."""

    POD = "pod"
    JOB = "job"
    NOTIFY = "notify"


DEFAULT_HEALTH_CHECK_IMAGE = "nvcr.io/nvidia/cloud-native/dcgm:4.2.3-1-ubuntu22.04"
"""Image of the validation Job (DCGM diagnostics)."""


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class Match:
    """What an incident must look like for a rule to apply (every given field must hold)."""

    fault_classes: frozenset[FaultClass] = frozenset()
    """Any of these fault classes (empty: any)."""
    min_severity: Severity | None = None
    """At least this severe."""
    hardware: bool | None = None
    """Hardware (True) or application (False) fault; None: either."""
    actions: frozenset[Action] = frozenset()
    """Any of these recommended actions (empty: any)."""
    node_labels: Mapping[str, str] = field(default_factory=dict)
    """Node label globs, e.g. ``nvidia.com/gpu.product: "*H100*"``."""
    job: str | None = None
    """Job name glob."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One policy rule."""

    name: str
    """Rule name (recorded on the plan)."""
    match: Match
    """When it applies."""
    plan: str
    """Name of the plan template."""
    mode: Mode
    """auto, approval or dry-run."""


@dataclass(frozen=True, slots=True)
class PlanTemplate:
    """A named list of steps."""

    name: str
    """Template name."""
    steps: tuple[StepName, ...]
    """Steps in order."""
    repair: RepairKind = RepairKind.REPLACE
    """What the repair step asks for."""
    drain: DrainScope = DrainScope.NODE
    """Whose pods the drain step evicts."""


@dataclass(frozen=True, slots=True)
class Safety:
    """Brakes on what the healer may do."""

    breaker_max_fraction: float = 0.10
    """Quarantining more than this fraction of GPU nodes within the window trips the breaker."""
    breaker_window_s: float = 3600.0
    """Window of the breaker."""
    max_plans_per_hour: int = 100
    """Plans that may start acting on the cluster in one hour."""
    node_cooldown_s: float = 3600.0
    """No new quarantine of a node within this long of its last one."""
    job_restart_window_s: float = 600.0
    """At most one restart of a job within this window."""


@dataclass(frozen=True, slots=True)
class Defaults:
    """Step parameters used when a job does not set its own."""

    drain_grace_s: int = 300
    """Grace period of evictions: long enough for the job to write a checkpoint."""
    drain_timeout_s: float = 1800.0
    """How long a drain may wait (PodDisruptionBudgets, terminating pods) before it fails."""
    checkpoint_path: str = ""
    """Checkpoint root when the job has no ``kmend.io/checkpoint-path`` annotation."""
    max_retry: int = 3
    """Restarts of a job before the healer only notifies."""
    escalation: tuple[Escalation, ...] = (Escalation.JOB, Escalation.NOTIFY)
    """Restart levels by attempt."""
    restart_timeout_s: float = 900.0
    """How long a restarted job may take to have every pod bound."""
    gpu_reset_when_idle: bool = True
    """Allow the node agent to reset a GPU once no process uses it."""
    validation_timeout_s: float = 1800.0
    """How long repair and validation may take before the plan fails."""
    health_check_image: str = DEFAULT_HEALTH_CHECK_IMAGE
    """Image of the validation Job (runs ``dcgmi diag -r 2``)."""
    gpu_assignment_annotations: tuple[str, ...] = ("kmend.io/gpus", "volcano.sh/gpu-index")
    """Pod annotations naming the GPUs a pod holds (index, UUID or PCI id, comma-separated), for a GPU drain."""


@dataclass(frozen=True, slots=True)
class PolicyFile:
    """A loaded, validated policy."""

    source: str
    """Where it came from."""
    rules: tuple[Rule, ...]
    """Rules in order; the first match wins."""
    plans: Mapping[str, PlanTemplate]
    """Plan templates by name."""
    safety: Safety
    """Brakes."""
    defaults: Defaults
    """Step parameters."""
    topology_keys: tuple[str, ...]
    """Node label keys from the narrowest domain to the widest (leaf, spine)."""
    fallback: Rule
    """Applies when no rule matches."""

    def choose(self, fault_class: FaultClass, severity: Severity, hardware: bool, action: Action,
               node_labels: Mapping[str, str], job: str | None) -> Rule:
        """The first rule that matches."""
        for r in self.rules:
            if _matches(r.match, fault_class, severity, hardware, action, node_labels, job):
                return r
        return self.fallback


def _matches(m: Match, fc: FaultClass, sev: Severity, hw: bool, action: Action, labels: Mapping[str, str],
             job: str | None) -> bool:
    if m.fault_classes and fc not in m.fault_classes:
        return False
    if m.min_severity is not None and SEVERITY_RANK[sev] < SEVERITY_RANK[m.min_severity]:
        return False
    if m.hardware is not None and m.hardware != hw:
        return False
    if m.actions and action not in m.actions:
        return False
    if any(not fnmatch.fnmatchcase(labels.get(k, ""), v) for k, v in m.node_labels.items()):
        return False
    return m.job is None or (job is not None and fnmatch.fnmatchcase(job, m.job))


# -- the YAML boundary ---------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _MatchModel(_Strict):
    fault_class: list[FaultClass] = Field(default_factory=list)
    min_severity: Severity | None = None
    hardware: bool | None = None
    recommended_action: list[Action] = Field(default_factory=list)
    node_labels: dict[str, str] = Field(default_factory=dict)
    job: str | None = None


class _RuleModel(_Strict):
    name: str = Field(min_length=1)
    match: _MatchModel = Field(default_factory=_MatchModel)
    plan: str
    mode: Mode = Mode.AUTO


class _PlanModel(_Strict):
    steps: list[StepName] = Field(min_length=1)
    repair: RepairKind = RepairKind.REPLACE
    drain: DrainScope = DrainScope.NODE

    @field_validator("steps")
    @classmethod
    def _quarantine_first(cls, steps: list[StepName]) -> list[StepName]:
        node_steps = {StepName.DRAIN, StepName.SPARE_SWAP, StepName.REPAIR, StepName.VALIDATE, StepName.RETURN}
        if node_steps & set(steps) and StepName.QUARANTINE not in steps:
            raise ValueError("a plan that drains, swaps, repairs or returns a node must quarantine it first")
        if len(set(steps)) != len(steps):
            raise ValueError("a step is listed twice")
        return steps


class _SafetyModel(_Strict):
    breaker_max_fraction: float = Field(0.10, gt=0, le=1)
    breaker_window_s: float = Field(3600.0, gt=0)
    max_plans_per_hour: int = Field(100, ge=1)
    node_cooldown_s: float = Field(3600.0, ge=0)
    job_restart_window_s: float = Field(600.0, ge=0)


class _DefaultsModel(_Strict):
    drain_grace_s: int = Field(300, ge=0)
    drain_timeout_s: float = Field(1800.0, gt=0)
    checkpoint_path: str = ""
    max_retry: int = Field(3, ge=0)
    escalation: list[Escalation] = Field(default_factory=lambda: [Escalation.JOB, Escalation.NOTIFY], min_length=1)
    restart_timeout_s: float = Field(900.0, gt=0)
    gpu_reset_when_idle: bool = True
    validation_timeout_s: float = Field(1800.0, gt=0)
    health_check_image: str = DEFAULT_HEALTH_CHECK_IMAGE
    gpu_assignment_annotations: list[str] = Field(
        default_factory=lambda: ["kmend.io/gpus", "volcano.sh/gpu-index"])


class _PolicyModel(_Strict):
    version: Literal[1] = 1
    safety: _SafetyModel = Field(default_factory=_SafetyModel)
    defaults: _DefaultsModel = Field(default_factory=_DefaultsModel)
    topology_keys: list[str] = Field(default_factory=lambda: ["topology.kmend.io/leaf", "topology.kmend.io/spine"])
    plans: dict[str, _PlanModel]
    rules: list[_RuleModel] = Field(min_length=1)
    fallback: _RuleModel = Field(default_factory=lambda: _RuleModel(name="fallback", plan="notify"))

    @model_validator(mode="after")
    def _plans_exist(self) -> _PolicyModel:
        for i, r in enumerate([*self.rules, self.fallback]):
            if r.plan not in self.plans:
                where = f"rules.{i}.plan" if i < len(self.rules) else "fallback.plan"
                raise ValueError(f"{where}: rule {r.name!r} names plan {r.plan!r}, which is not in plans "
                                 f"({', '.join(sorted(self.plans))})")
        return self


def _rule(m: _RuleModel) -> Rule:
    mm = m.match
    return Rule(m.name, Match(frozenset(mm.fault_class), mm.min_severity, mm.hardware,
                              frozenset(mm.recommended_action), dict(mm.node_labels), mm.job), m.plan, m.mode)


def parse_policy(data: Any, source: str) -> PolicyFile:
    """Validate a parsed YAML document; errors name the source and the dotted field path."""
    try:
        m = _PolicyModel.model_validate(data)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        path = ".".join(str(p) for p in e["loc"]) or "(document)"
        raise PolicyError(f"{source}: {path}: {e['msg']}") from None
    d = m.defaults
    return PolicyFile(
        source=source,
        rules=tuple(_rule(r) for r in m.rules),
        plans={n: PlanTemplate(n, tuple(p.steps), p.repair, p.drain) for n, p in m.plans.items()},
        safety=Safety(**m.safety.model_dump()),
        defaults=Defaults(d.drain_grace_s, d.drain_timeout_s, d.checkpoint_path, d.max_retry, tuple(d.escalation),
                          d.restart_timeout_s, d.gpu_reset_when_idle, d.validation_timeout_s,
                          d.health_check_image, tuple(d.gpu_assignment_annotations)),
        topology_keys=tuple(m.topology_keys),
        fallback=_rule(m.fallback),
    )


def default_policy_path() -> Path:
    """The shipped default policy."""
    return Path(str(resources.files("healer") / "policies" / "default.yaml"))


def load_policy(path: Path | None = None) -> PolicyFile:
    """Load and validate a policy file (the shipped default when `path` is None)."""
    path = path or default_policy_path()
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not valid YAML: {exc}") from None
    return parse_policy(data, str(path))
