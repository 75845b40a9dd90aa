"""Rule packs: YAML data compiled into typed, validated Rule records.

A bad rule fails at load with its file, rule id and field (node-problem-detector
habit): the service refuses to start rather than silently missing a fault.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from analyzer.records import Action, FaultClass, Severity

RuleSource = Literal["kernel", "container", "any"]


class RuleError(ValueError):
    """A rule pack is invalid; the message names file, rule id and field."""

    def __init__(self, path: str, rule_id: str | None, field: str, problem: str) -> None:
        self.path = path
        self.rule_id = rule_id
        self.field = field
        self.problem = problem
        where = f"{path}: rule {rule_id!r}" if rule_id else path
        super().__init__(f"{where}: field {field!r}: {problem}")


class EscalationSpec(BaseModel):
    """Escalate when the same rule fires `count` times on one GPU/node within `window` seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = Field(ge=2)
    window: float = Field(gt=0, description="seconds")
    per: Literal["gpu", "node", "port"] = "gpu"
    fault_class: FaultClass | None = None
    hardware: bool = True
    recommended_action: Action = Action.REPLACE_NODE
    severity: Severity = Severity.CRITICAL


class RuleSpec(BaseModel):
    """A rule as written in YAML (validated boundary model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str
    sources: tuple[RuleSource, ...] = ("any",)
    pattern: str
    fault_class: FaultClass
    severity: Severity
    hardware: bool | Literal["depends"]
    recommended_action: Action
    symptom_of: tuple[FaultClass, ...] = ()
    escalation: EscalationSpec | None = None
    fields: dict[str, str] = Field(default_factory=dict)
    examples: tuple[str, ...] = Field(min_length=1)
    counter_examples: tuple[str, ...] = ()
    references: tuple[str, ...] = Field(min_length=1)

    @field_validator("references")
    @classmethod
    def _urls(cls, refs: tuple[str, ...]) -> tuple[str, ...]:
        for ref in refs:
            if not ref.startswith(("https://", "http://")):
                raise ValueError(f"reference {ref!r} is not a URL")
        return refs


@dataclass(frozen=True, slots=True)
class Rule:
    """A compiled rule."""

    id: str
    """Unique id across all packs."""
    pack: str
    """Name of the pack (file stem) it came from."""
    description: str
    """What the rule detects."""
    sources: frozenset[str]
    """Signal sources it applies to (``kernel``, ``container``); empty means any."""
    pattern: str
    """Regular expression as written."""
    regex: re.Pattern[str]
    """Compiled pattern, named groups extract fields."""
    fault_class: FaultClass
    """Class of the findings it produces."""
    severity: Severity
    """Severity of its findings."""
    hardware: bool | Literal["depends"]
    """Hardware fault, application fault, or "depends" (escalation decides)."""
    recommended_action: Action
    """Action for a single occurrence."""
    symptom_of: frozenset[FaultClass]
    """Classes that explain this finding when present nearby."""
    escalation: EscalationSpec | None
    """Repeat threshold that turns it into a hardware finding."""
    fields: tuple[tuple[str, str], ...]
    """Constant fields added to every finding (e.g. ``xid: "79"``)."""
    examples: tuple[str, ...]
    """Real lines that must match."""
    counter_examples: tuple[str, ...]
    """Real lines that must not match."""
    references: tuple[str, ...]
    """Where the examples come from."""

    def applies_to(self, source: str) -> bool:
        """Whether the rule looks at lines of this signal source."""
        return not self.sources or source in self.sources


# Constructs that need a backtracking engine: refused so user rules cannot enable ReDoS.
_BACKTRACKING = re.compile(r"\\[1-9]|\(\?[=!<]|\(\?P=|\(\?>|[*+?}]\+")


def _compile(path: str, spec: RuleSpec) -> re.Pattern[str]:
    if _BACKTRACKING.search(spec.pattern):
        raise RuleError(
            path, spec.id, "pattern",
            "uses backreferences, lookaround or possessive/atomic groups; "
            "only linear-time regex syntax is allowed",
        )
    try:
        return re.compile(spec.pattern)
    except re.error as exc:
        raise RuleError(path, spec.id, "pattern", f"does not compile: {exc}") from exc


def _build(path: str, pack: str, spec: RuleSpec) -> Rule:
    regex = _compile(path, spec)
    for i, line in enumerate(spec.examples):
        if not regex.search(line):
            raise RuleError(path, spec.id, f"examples[{i}]", f"does not match: {line!r}")
    for i, line in enumerate(spec.counter_examples):
        if regex.search(line):
            raise RuleError(path, spec.id, f"counter_examples[{i}]", f"matches: {line!r}")
    sources = frozenset(s for s in spec.sources if s != "any")
    return Rule(
        id=spec.id, pack=pack, description=spec.description, sources=sources,
        pattern=spec.pattern, regex=regex, fault_class=spec.fault_class,
        severity=spec.severity, hardware=spec.hardware,
        recommended_action=spec.recommended_action,
        symptom_of=frozenset(spec.symptom_of), escalation=spec.escalation,
        fields=tuple(sorted(spec.fields.items())), examples=spec.examples,
        counter_examples=spec.counter_examples, references=spec.references,
    )


def _field_path(err: Any) -> str:
    return ".".join(str(p) for p in err["loc"])


def load_pack(path: Path) -> list[Rule]:
    """Load and validate one YAML pack; raises RuleError on the first bad rule."""
    name = str(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RuleError(name, None, "<yaml>", str(exc)) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise RuleError(name, None, "rules", "a pack is a mapping with a 'rules' list")
    rules: list[Rule] = []
    for i, raw in enumerate(doc["rules"]):
        rid = raw.get("id") if isinstance(raw, dict) else None
        try:
            spec = RuleSpec.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise RuleError(name, rid or f"#{i}", _field_path(first), first["msg"]) from exc
        rules.append(_build(name, path.stem, spec))
    return rules


def load_rules(paths: Iterable[Path]) -> list[Rule]:
    """Load packs from files or directories (``*.yaml``); rule ids must be unique."""
    files: list[Path] = []
    for p in paths:
        files.extend(sorted(p.glob("*.yaml")) if p.is_dir() else [p])
    seen: dict[str, str] = {}
    rules: list[Rule] = []
    for f in files:
        for rule in load_pack(f):
            if rule.id in seen:
                raise RuleError(str(f), rule.id, "id", f"duplicate of a rule in {seen[rule.id]}")
            seen[rule.id] = str(f)
            rules.append(rule)
    return rules


def default_rules_dir() -> Path:
    """The shipped rule packs (``rules/`` at the project root)."""
    return Path(__file__).resolve().parent.parent / "rules"


def rule_ids(rules: Sequence[Rule]) -> list[str]:
    """Ids of the rules, in load order."""
    return [r.id for r in rules]
