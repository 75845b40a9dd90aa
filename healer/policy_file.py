"""The healing policy file: YAML validated at load (file and field in every error), frozen records inside.

The shipped default is ``healer/policies/default.yaml``; deployments point ``KMEND_POLICY_FILE`` at
their own. Rules are tried in file order and the first that matches an incident names its plan and mode;
a rule that an earlier rule fully shadows (every incident it matches, the earlier one matches first) is
an error at load, so the order a reader sees is the order that decides.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
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


class OptIn(StrEnum):
    """Kinds of evidence whose plans wait for a person unless the operator lets them run automatically."""

    NETWORK = "network"
    """InfiniBand/RoCE/NIC: often a switch or cable, not the node."""
    NVLINK = "nvlink"
    """NVLink/NVSwitch/fabric manager: often the baseboard or the fabric, not one GPU."""
    SOFT = "soft"
    """Stragglers and thermal/power slowdowns: a trend, not a failure."""


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
    rules: tuple[str, ...] = ()
    """Globs on the root finding's rule or detector id (``xid-79``, ``straggler-*``) (empty: any)."""
    culprit: bool | None = None
    """A detector (Flight Recorder, hang detector) named the culprit rank or node; None: either."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What rules are matched against: the incident as the policy sees it."""

    fault_class: FaultClass
    """Fault class of the root cause."""
    severity: Severity
    """Highest severity."""
    hardware: bool
    """Hardware (True) or application (False) fault."""
    action: Action
    """Recommended action of the incident."""
    node_labels: Mapping[str, str] = field(default_factory=dict)
    """Labels of the root-cause node."""
    job: str | None = None
    """Job affected."""
    rule_id: str = ""
    """Rule or detector id of the root finding (the evidence kind)."""
    culprit: bool = False
    """A detector named the culprit rank or node."""


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
    opt_in: OptIn | None = None
    """Kind of evidence: an approval rule runs automatically when the policy's ``automatic`` lists it."""
    min_findings: int = 1
    """Cause findings the incident needs before a plan is made (soft evidence must repeat)."""
    fresh_s: float | None = None
    """The newest of them must be at most this old when the plan is made (None: any age)."""


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
    max_out_fraction: float = 0.10
    """No automatic quarantine while this fraction of GPU nodes is already out (quarantined by kmend or
    not yet validated), however long ago they went out: the level, beside the window's rate."""
    attempts_window_s: float = 7 * 86400.0
    """Remediation attempts on a node or GPU within this long count toward ``max_attempts``."""
    max_attempts: int = 1
    """Attempts of one repair kind on a node (a GPU for resets) before the next rung of the ladder
    (reset -> reboot -> replace -> a person)."""
    lemon_faults: int = 3
    """A node with this many hardware-fault plans within ``lemon_window_s`` is a lemon: replaced, reported."""
    lemon_window_s: float = 30 * 86400.0
    """Window of the lemon count."""


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
class Validation:
    """What the health-check Job of a new or repaired node runs before the node takes work."""

    new_nodes: bool = True
    """Taint nodes kmend has not validated yet ``kmend.io/unvalidated:NoSchedule`` and check them."""
    dcgm_level: int = 2
    """``dcgmi diag -r`` level (1 quick, 2 medium, 3 long, 4 extended)."""
    nccl_min_busbw_gbps: float = 0.0
    """Minimum all-reduce bus bandwidth across the node's GPUs (``all_reduce_perf``); 0: run, do not judge."""
    ib_loopback: bool = False
    """Also run an InfiniBand loopback bandwidth test on each HCA."""
    timeout_s: float = 1800.0
    """How long the Job may take before the node counts as failed."""


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
    automatic: frozenset[OptIn] = frozenset()
    """Kinds of evidence the operator lets run without approval."""
    validation: Validation = field(default_factory=lambda: Validation())
    """Acceptance checks of new and repaired nodes."""

    def choose(self, facts: Facts) -> Rule:
        """The first rule that matches."""
        for r in self.rules:
            if mismatch(r.match, facts) is None:
                return r
        return self.fallback

    def mode_of(self, rule: Rule) -> Mode:
        """The rule's mode, with the operator's opt-ins applied."""
        if rule.mode is Mode.APPROVAL and rule.opt_in is not None and rule.opt_in in self.automatic:
            return Mode.AUTO
        return rule.mode


def _names(values: Iterable[str]) -> str:
    return "[" + ", ".join(sorted(values)) + "]"


def mismatch(m: Match, f: Facts) -> str | None:
    """Why the match does not hold (the first field that fails), or None when it holds."""
    if m.fault_classes and f.fault_class not in m.fault_classes:
        return f"fault_class {f.fault_class.value} not in {_names(m.fault_classes)}"
    if m.min_severity is not None and SEVERITY_RANK[f.severity] < SEVERITY_RANK[m.min_severity]:
        return f"severity {f.severity.value} below {m.min_severity.value}"
    if m.hardware is not None and m.hardware != f.hardware:
        return f"hardware is {str(f.hardware).lower()}, the rule wants {str(m.hardware).lower()}"
    if m.actions and f.action not in m.actions:
        return f"recommended_action {f.action.value} not in {_names(m.actions)}"
    if m.rules and not any(fnmatch.fnmatchcase(f.rule_id, g) for g in m.rules):
        return f"rule {f.rule_id or '-'} not in {_names(m.rules)}"
    if m.culprit is not None and m.culprit != f.culprit:
        return "no detector named the culprit rank or node" if m.culprit else "a detector named the culprit"
    for k, v in m.node_labels.items():
        if not fnmatch.fnmatchcase(f.node_labels.get(k, ""), v):
            return f"node label {k}={f.node_labels.get(k, '')!r} does not match {v!r}"
    if m.job is not None and (f.job is None or not fnmatch.fnmatchcase(f.job, m.job)):
        return f"job {f.job or '-'} does not match {m.job!r}"
    return None


def covers(a: Match, b: Match) -> bool:
    """Whether every incident `b` matches, `a` matches too (conservative: globs compare as written)."""
    def subset(outer: frozenset[Any], inner: frozenset[Any]) -> bool:
        return not outer or (bool(inner) and inner <= outer)
    if not subset(a.fault_classes, b.fault_classes) or not subset(a.actions, b.actions):
        return False
    if a.min_severity is not None and (
            b.min_severity is None or SEVERITY_RANK[b.min_severity] < SEVERITY_RANK[a.min_severity]):
        return False
    if a.hardware is not None and a.hardware != b.hardware:
        return False
    if a.culprit is not None and a.culprit != b.culprit:
        return False
    if a.rules and not (b.rules and all(any(fnmatch.fnmatchcase(x, g) for g in a.rules) for x in b.rules)):
        return False
    if any(k not in b.node_labels or not fnmatch.fnmatchcase(b.node_labels[k], v) for k, v in a.node_labels.items()):
        return False
    return a.job is None or (b.job is not None and fnmatch.fnmatchcase(b.job, a.job))


def check_shadowing(rules: Sequence[Rule], source: str) -> None:
    """A rule that can never match because an earlier rule takes all its incidents is an error."""
    for j, later in enumerate(rules):
        for i, earlier in enumerate(rules[:j]):
            if covers(earlier.match, later.match):
                raise PolicyError(f"{source}: rules.{j}: rule {later.name!r} never matches: rule {earlier.name!r} "
                                  f"(rules.{i}) comes first and matches every incident it does; put the narrower "
                                  "rule first or narrow the earlier one")


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
    rule: list[str] = Field(default_factory=list)
    culprit: bool | None = None


class _RuleModel(_Strict):
    name: str = Field(min_length=1)
    match: _MatchModel = Field(default_factory=_MatchModel)
    plan: str
    mode: Mode = Mode.AUTO
    opt_in: OptIn | None = None
    min_findings: int = Field(1, ge=1)
    fresh_s: float | None = Field(None, gt=0)


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
    max_out_fraction: float = Field(0.10, gt=0, le=1)
    attempts_window_s: float = Field(7 * 86400.0, ge=0)
    max_attempts: int = Field(1, ge=1)
    lemon_faults: int = Field(3, ge=2)
    lemon_window_s: float = Field(30 * 86400.0, gt=0)


class _ValidationModel(_Strict):
    new_nodes: bool = True
    dcgm_level: int = Field(2, ge=1, le=4)
    nccl_min_busbw_gbps: float = Field(0.0, ge=0)
    ib_loopback: bool = False
    timeout_s: float = Field(1800.0, gt=0)


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
    automatic: list[OptIn] = Field(default_factory=list)
    validation: _ValidationModel = Field(default_factory=_ValidationModel)

    @model_validator(mode="after")
    def _unique_names(self) -> _PolicyModel:
        seen: dict[str, int] = {}
        for i, r in enumerate(self.rules):
            if r.name in seen:
                raise ValueError(f"rules.{i}.name: rule name {r.name!r} is also rules.{seen[r.name]}")
            seen[r.name] = i
        return self

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
                              frozenset(mm.recommended_action), dict(mm.node_labels), mm.job, tuple(mm.rule),
                              mm.culprit),
                m.plan, m.mode, m.opt_in, m.min_findings, m.fresh_s)


def parse_policy(data: Any, source: str) -> PolicyFile:
    """Validate a parsed YAML document; errors name the source and the dotted field path."""
    try:
        m = _PolicyModel.model_validate(data)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        path = ".".join(str(p) for p in e["loc"]) or "(document)"
        raise PolicyError(f"{source}: {path}: {e['msg']}") from None
    d = m.defaults
    rules = tuple(_rule(r) for r in m.rules)
    check_shadowing(rules, source)
    return PolicyFile(
        source=source,
        rules=rules,
        plans={n: PlanTemplate(n, tuple(p.steps), p.repair, p.drain) for n, p in m.plans.items()},
        safety=Safety(**m.safety.model_dump()),
        defaults=Defaults(d.drain_grace_s, d.drain_timeout_s, d.checkpoint_path, d.max_retry, tuple(d.escalation),
                          d.restart_timeout_s, d.gpu_reset_when_idle, d.validation_timeout_s,
                          d.health_check_image, tuple(d.gpu_assignment_annotations)),
        topology_keys=tuple(m.topology_keys),
        fallback=_rule(m.fallback),
        automatic=frozenset(m.automatic),
        validation=Validation(**m.validation.model_dump()),
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
