"""Rule packs: YAML data compiled into typed, validated Rule records.

A bad rule fails at load with its file, rule id and field (node-problem-detector
habit): the service refuses to start rather than silently missing a fault.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import re2
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from analyzer.decode import ActionMap, Decoder, DecodeRow, StatusMatch
from analyzer.packs import default_rules_dir as default_rules_dir
from analyzer.records import Action, FaultClass, Severity
from collector.normalize import events_of

RuleSource = Literal["kernel", "container", "any"]


class RegexMatch(Protocol):
    """A match of a linear-time regex (RE2's match object; the subset of ``re.Match`` we use)."""

    def groupdict(self) -> dict[str, str | None]: ...

    def start(self, group: int = 0) -> int: ...

    def end(self, group: int = 0) -> int: ...


class LinearRegex(Protocol):
    """A compiled pattern whose search time is linear in the text (RE2): no input can make it backtrack."""

    @property
    def pattern(self) -> str: ...

    @property
    def groupindex(self) -> Mapping[str, int]: ...

    def search(self, text: str) -> RegexMatch | None: ...

    def fullmatch(self, text: str) -> RegexMatch | None: ...

    def finditer(self, text: str) -> Iterator[RegexMatch]: ...


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
    """Escalate when the same rule fires `count` times on one GPU/node/port within `window` seconds,
    or when it fires together with one of `together_with` on the same device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int = Field(default=2, ge=1)
    window: float = Field(gt=0, description="seconds")
    per: Literal["gpu", "node", "port"] = "gpu"
    min_gap: float = Field(default=0.0, ge=0, description="occurrences closer than this count once")
    together_with: tuple[str, ...] = ()
    fault_class: FaultClass | None = None
    hardware: bool = True
    recommended_action: Action = Action.REPLACE_NODE
    severity: Severity = Severity.CRITICAL

    @model_validator(mode="after")
    def _repeat_or_companion(self) -> EscalationSpec:
        if self.count < 2 and not self.together_with:
            raise ValueError("count must be at least 2 unless together_with names companion rules")
        return self


class BenignWhenSpec(BaseModel):
    """Context that makes a finding benign: a line on the same node within `window` seconds, before or after.

    systemd's ``Stopping ... kubelet`` around ``kubelet.service: main process exited`` is a deliberate
    restart, not a crash; fabric manager failing on a host that reports no NVSwitch has nothing to manage.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    context: tuple[str, ...] = Field(min_length=1, description="patterns (RE2, one line each)")
    window: float = Field(gt=0, description="seconds either side of the finding")
    why: str = Field(min_length=10)
    examples: tuple[str, ...] = Field(min_length=1, description="real context lines that must match")
    counter_examples: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BenignContext:
    """A compiled ``benign_when``: any of its patterns seen near a finding on the same node silences it."""

    patterns: tuple[str, ...]
    """The context patterns as written (the node-side prefilter must ship these lines too)."""
    regex: LinearRegex
    """The context patterns as one alternation (RE2)."""
    window: float
    """Seconds either side of the finding."""
    why: str
    """Why the context makes the finding benign (shown by ``kmend rules test``)."""
    examples: tuple[str, ...]
    """Real context lines that must match."""


class ActionFromSpec(BaseModel):
    """The action is named in the line itself (e.g. Xid 154): field value -> action."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    field: str
    values: dict[str, Action] = Field(min_length=1)


class DecodeRowSpec(BaseModel):
    """One row of a register decode table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unit: str
    intrinfo: tuple[str, ...] = Field(min_length=1)
    status: tuple[str, ...] = ()
    match: StatusMatch = StatusMatch.BITS
    action: Action
    severity: Severity
    hardware: bool | None = None

    @field_validator("intrinfo")
    @classmethod
    def _bit_patterns(cls, pats: tuple[str, ...]) -> tuple[str, ...]:
        for p in pats:
            if not p or set(p) - set("01-"):
                raise ValueError(f"bit pattern {p!r} may hold only 0, 1 and -")
        return pats

    @field_validator("status")
    @classmethod
    def _hex_values(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for v in values:
            int(v, 16)
        return values


class DecodeSpec(BaseModel):
    """Decode two hex registers captured from the line into action and severity."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    intrinfo_field: str
    status_field: str
    rows: tuple[DecodeRowSpec, ...] = Field(min_length=1)


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
    benign_when: BenignWhenSpec | None = None
    action_from: ActionFromSpec | None = None
    decode: DecodeSpec | None = None
    fields: dict[str, str] = Field(default_factory=dict)
    examples: tuple[str, ...] = Field(min_length=1)
    counter_examples: tuple[str, ...] = ()
    references: tuple[str, ...] = Field(min_length=1)
    generic: bool = False

    @field_validator("references")
    @classmethod
    def _urls(cls, refs: tuple[str, ...]) -> tuple[str, ...]:
        return check_urls(refs)


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
    regex: LinearRegex
    """Compiled by RE2 (linear time), named groups extract fields."""
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
    action_from: ActionMap | None
    """Action named by the line itself; overrides ``recommended_action`` when it applies."""
    decoder: Decoder | None
    """Register decode that picks action and severity; overrides the fixed ones when a row applies."""
    fields: tuple[tuple[str, str], ...]
    """Constant fields added to every finding (e.g. ``xid: "79"``)."""
    examples: tuple[str, ...]
    """Real lines that must match."""
    counter_examples: tuple[str, ...]
    """Real lines that must not match."""
    references: tuple[str, ...]
    """Where the examples come from."""
    benign_when: BenignContext | None = None
    """Context on the same node that makes a finding of this rule benign (it is then dropped)."""
    generic: bool = False
    """A catch-all (any ``ValueError``): a specific rule matching the same event names the cause instead."""

    def applies_to(self, source: str) -> bool:
        """Whether the rule looks at lines of this signal source."""
        return not self.sources or source in self.sources


# Constructs that need a backtracking engine, named in the error before RE2 is asked.
# `(?<name>` is a named group, not a lookbehind, so it is allowed.
_BACKTRACKING = re.compile(r"\\[1-9]|\\g<|\(\?(?:[=!]|<[=!])|\(\?P=|\(\?>|\(\?\(|[*+?}]\+")
_LINEAR_ONLY = (
    "needs a backtracking engine (backreference, lookaround, conditional or possessive/atomic group); "
    "only linear-time regex syntax is allowed"
)


def _re2_options() -> re2.Options:
    opts = re2.Options()
    opts.log_errors = False  # the RuleError says what is wrong; RE2 would also print to stderr
    return opts


def compile_linear(path: str, rule_id: str, pattern: str, *, field: str = "pattern",
                   multiline: bool = False) -> LinearRegex:
    """Compile a rule's pattern with RE2, which runs in time linear in the text.

    Every match the service confirms and every field it extracts comes from RE2, so no
    pattern can make one line cost more than a pass over it. What RE2 cannot take
    (backreferences, lookaround) is refused here, naming file, rule and field.
    ``multiline``: for lines joined by newlines: ^ and $ anchor at line boundaries and no match
    runs over a newline (one that did would hide the following lines' own matches).
    """
    if _BACKTRACKING.search(pattern):
        raise RuleError(path, rule_id, field, _LINEAR_ONLY)
    opts = _re2_options()
    opts.never_nl = multiline
    try:
        compiled: LinearRegex = re2.compile(("(?m)" if multiline else "") + pattern, options=opts)
    except re2.error as exc:
        raise RuleError(path, rule_id, field, f"{_LINEAR_ONLY} (RE2: {_re2_message(exc)})") from exc
    return compiled


def _re2_message(exc: BaseException) -> str:
    msg = exc.args[0] if exc.args else exc
    return msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)


def check_urls(refs: tuple[str, ...]) -> tuple[str, ...]:
    """Every reference must be a URL (where the example lines came from)."""
    for ref in refs:
        if not ref.startswith(("https://", "http://")):
            raise ValueError(f"reference {ref!r} is not a URL")
    return refs


def _compile(path: str, spec: RuleSpec) -> LinearRegex:
    regex = compile_linear(path, spec.id, spec.pattern)
    if regex.search(""):
        raise RuleError(path, spec.id, "pattern", "matches the empty string, so it would match every line")
    return regex


def _need_group(path: str, spec: RuleSpec, regex: LinearRegex, field: str, name: str) -> None:
    if name not in regex.groupindex:
        raise RuleError(path, spec.id, field, f"names group {name!r} that the pattern does not capture")


def _action_map(path: str, spec: RuleSpec, regex: LinearRegex) -> ActionMap | None:
    a = spec.action_from
    if a is None:
        return None
    _need_group(path, spec, regex, "action_from.field", a.field)
    return ActionMap(field=a.field, values=tuple(sorted(a.values.items())))


def _decoder(path: str, spec: RuleSpec, regex: LinearRegex) -> Decoder | None:
    d = spec.decode
    if d is None:
        return None
    _need_group(path, spec, regex, "decode.intrinfo_field", d.intrinfo_field)
    _need_group(path, spec, regex, "decode.status_field", d.status_field)
    rows = tuple(
        DecodeRow(unit=r.unit, intrinfo=r.intrinfo, status=tuple(int(v, 16) for v in r.status),
                  match=r.match, action=r.action, severity=r.severity, hardware=r.hardware)
        for r in d.rows
    )
    return Decoder(intrinfo_field=d.intrinfo_field, status_field=d.status_field, rows=rows)


def _events(example: str) -> list[str]:
    return events_of(example) if "\n" in example.strip("\n") else [example]


def _build(path: str, pack: str, spec: RuleSpec) -> Rule:
    regex = _compile(path, spec)
    # A multi-line example is a verbatim block (an nvidia-smi -q section, a dcgmi table): the rule
    # sees it as the folded event text, as `kmend analyze` would, and keeps that as its example.
    examples: list[str] = []
    for i, line in enumerate(spec.examples):
        event = next((t for t in _events(line) if regex.search(t)), None)
        if event is None:
            raise RuleError(path, spec.id, f"examples[{i}]", f"does not match: {line!r}")
        examples.append(event)
    counter: list[str] = []
    for i, line in enumerate(spec.counter_examples):
        for t in _events(line):
            if regex.search(t):
                raise RuleError(path, spec.id, f"counter_examples[{i}]", f"matches: {t!r}")
            counter.append(t)
    sources = frozenset(s for s in spec.sources if s != "any")
    return Rule(
        id=spec.id, pack=pack, description=spec.description, sources=sources,
        pattern=spec.pattern, regex=regex, fault_class=spec.fault_class,
        severity=spec.severity, hardware=spec.hardware,
        recommended_action=spec.recommended_action,
        symptom_of=frozenset(spec.symptom_of), escalation=spec.escalation,
        action_from=_action_map(path, spec, regex), decoder=_decoder(path, spec, regex),
        fields=tuple(sorted(spec.fields.items())), examples=tuple(examples),
        counter_examples=tuple(counter), references=spec.references,
        benign_when=_benign_context(path, spec), generic=spec.generic,
    )


def _benign_context(path: str, spec: RuleSpec) -> BenignContext | None:
    ctx = spec.benign_when
    if ctx is None:
        return None
    for i, pat in enumerate(ctx.context):
        compile_linear(path, spec.id, pat, field=f"benign_when.context[{i}]")
    regex = compile_linear(path, spec.id, "|".join(f"(?:{p})" for p in ctx.context), field="benign_when.context",
                           multiline=True)
    for i, line in enumerate(ctx.examples):
        if not regex.search(line):
            raise RuleError(path, spec.id, f"benign_when.examples[{i}]", f"matches no context pattern: {line!r}")
    for i, line in enumerate(ctx.counter_examples):
        if regex.search(line):
            raise RuleError(path, spec.id, f"benign_when.counter_examples[{i}]", f"matches: {line!r}")
    return BenignContext(patterns=ctx.context, regex=regex, window=ctx.window, why=ctx.why, examples=ctx.examples)


def _field_path(err: ErrorDetails) -> str:
    return ".".join(str(p) for p in err["loc"])


def load_yaml(text: str) -> object:
    """A YAML document, parsed by libyaml where PyYAML was built with it (the pure-Python parser was a quarter of
    the service's start-up); safe either way: plain data only."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_pack(path: Path) -> list[Rule]:
    """Load and validate one YAML pack; raises RuleError on the first bad rule."""
    name = str(path)
    try:
        doc = load_yaml(path.read_text(encoding="utf-8"))
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


class _Identified(Protocol):
    @property
    def id(self) -> str: ...


IdentifiedT = TypeVar("IdentifiedT", bound=_Identified)


def load_packs(paths: Iterable[Path],
               load_one: Callable[[Path], list[IdentifiedT]]) -> tuple[list[IdentifiedT], dict[str, str]]:
    """Every pack in files or directories (``*.yaml``, sorted), ids unique across them.

    Returns the rules in load order and, for each id, the file it came from.
    """
    files: list[Path] = []
    for p in paths:
        files.extend(sorted(p.glob("*.yaml")) if p.is_dir() else [p])
    seen: dict[str, str] = {}
    rules: list[IdentifiedT] = []
    for f in files:
        for rule in load_one(f):
            if rule.id in seen:
                raise RuleError(str(f), rule.id, "id", f"duplicate of a rule in {seen[rule.id]}")
            seen[rule.id] = str(f)
            rules.append(rule)
    return rules, seen


def load_rules(paths: Iterable[Path]) -> list[Rule]:
    """Load packs from files or directories (``*.yaml``); rule ids must be unique."""
    rules, seen = load_packs(paths, load_pack)
    for rule in rules:
        for other in rule.escalation.together_with if rule.escalation else ():
            if other not in seen:
                raise RuleError(seen[rule.id], rule.id, "escalation.together_with", f"unknown rule {other!r}")
    return rules


def context_patterns(rules: Iterable[Rule], source: str | None = None) -> list[str]:
    """Patterns of the lines that make findings benign (``benign_when``), of rules that look at ``source``.

    A prefilter or a bundle reader keeps these lines as it keeps the rules' own: without them the
    context never reaches the analyzer.
    """
    return [p for r in rules if r.benign_when is not None and (source is None or r.applies_to(source))
            for p in r.benign_when.patterns]


def rule_ids(rules: Sequence[Rule]) -> list[str]:
    """Ids of the rules, in load order."""
    return [r.id for r in rules]
