"""Metric and alert rule packs: YAML data compiled into typed MetricRule / AlertRule records.

A pack under ``rules/metrics/`` holds ``metric_rules`` (conditions on MetricSample series
from NVML, DCGM and InfiniBand) and ``alert_rules`` (Alertmanager alert names and labels).
Validation is the log packs': a bad rule fails at load naming file, rule id and field, and
every rule's examples (real exporter lines, real alert labels) must fire while its
counter-examples stay silent, replayed through the same evaluator the service runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from analyzer.packs import default_metric_rules_dir as default_metric_rules_dir
from analyzer.records import Action, FaultClass, Severity
from analyzer.rules import LinearRegex, RuleError, check_urls, compile_linear, load_packs, load_yaml
from collector.exposition import exposition_samples


class Condition(StrEnum):
    """What a metric rule tests on a series."""

    INCREASED = "increased"
    """The counter rose since the previous sample (by at least ``min_delta``)."""
    ABOVE = "above"
    """The value is above ``threshold``."""
    BELOW = "below"
    """The value is below ``threshold``."""
    EQUALS = "equals"
    """The value is one of ``values``."""
    BITS_ANY = "bits_any"
    """The value, as an integer bit mask, has any bit of ``mask`` set."""
    LEFT = "left"
    """The value was one of ``values`` and is none of them now (a port that left ACTIVE); a series never seen in
    one of them (a port down since the first read: unused on purpose) never fires."""


class MetricExample(BaseModel):
    """Exposition lines of one series, oldest first; the rule must fire on the last (or must not)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    samples: tuple[str, ...] = Field(min_length=1)
    seconds_apart: float = Field(default=15.0, gt=0, description="time between the samples")


class MetricRuleSpec(BaseModel):
    """A metric rule as written in YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str
    metrics: tuple[str, ...] = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict, description="label -> fully anchored regex")
    condition: Condition
    threshold: float | None = None
    values: tuple[float, ...] = ()
    mask: int | None = Field(default=None, ge=1)
    min_delta: float = Field(default=1.0, gt=0)
    min_rate_per_minute: float | None = Field(default=None, gt=0)
    baseline: Literal["first", "zero"] = Field(
        default="first", description="first sample of a counter: only a baseline, or an increase from zero")
    for_samples: int = Field(default=1, ge=1, le=1000)
    every_sample: bool = Field(default=False, description="each sample is an event (NVML Xid events)")
    refire_on_change: bool = Field(default=False, description="fire again when the value changes while it holds")
    classify_xid: Literal["value", "label"] | None = Field(
        default=None, description="take class and action from the log rule xid-<code>; code from value or xid label")
    fault_class: FaultClass
    severity: Severity
    hardware: bool
    recommended_action: Action
    examples: tuple[MetricExample, ...] = Field(min_length=1)
    counter_examples: tuple[MetricExample, ...] = ()
    references: tuple[str, ...] = Field(min_length=1)

    @field_validator("references")
    @classmethod
    def _urls(cls, refs: tuple[str, ...]) -> tuple[str, ...]:
        return check_urls(refs)

    @model_validator(mode="after")
    def _condition_fields(self) -> MetricRuleSpec:
        c = self.condition
        if c in (Condition.ABOVE, Condition.BELOW) and self.threshold is None:
            raise ValueError(f"condition {c.value!r} needs a threshold")
        if c in (Condition.EQUALS, Condition.LEFT) and not self.values:
            raise ValueError(f"condition {c.value!r} needs values")
        if c is Condition.BITS_ANY and self.mask is None:
            raise ValueError("condition 'bits_any' needs a mask")
        if self.min_rate_per_minute is not None and c is not Condition.INCREASED:
            raise ValueError("min_rate_per_minute applies only to condition 'increased'")
        return self


class AlertRuleSpec(BaseModel):
    """An alert rule as written in YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str
    names: tuple[str, ...] = Field(min_length=1, description="alertname, or the node condition / event reason")
    labels: dict[str, str] = Field(default_factory=dict, description="label -> fully anchored regex")
    xid_labels: tuple[str, ...] = Field(
        default=(), description="labels that may carry the Xid code; with one, classify like the log rule xid-<code>")
    fault_class: FaultClass
    severity: Severity
    hardware: bool
    recommended_action: Action
    examples: tuple[dict[str, str], ...] = Field(min_length=1)
    counter_examples: tuple[dict[str, str], ...] = ()
    references: tuple[str, ...] = Field(min_length=1)

    @field_validator("references")
    @classmethod
    def _urls(cls, refs: tuple[str, ...]) -> tuple[str, ...]:
        return check_urls(refs)


LabelMatchers = tuple[tuple[str, LinearRegex], ...]


def labels_match(matchers: LabelMatchers, labels: Mapping[str, str]) -> bool:
    """Prometheus ``=~`` semantics: the whole value matches; a missing label is the empty string."""
    return all(rx.fullmatch(labels.get(name, "")) for name, rx in matchers)


@dataclass(frozen=True, slots=True)
class MetricRule:
    """A compiled metric rule."""

    id: str
    """Unique id across all metric and alert packs."""
    pack: str
    """Pack (file stem) it came from."""
    description: str
    """What the rule detects."""
    metrics: frozenset[str]
    """Metric names it looks at."""
    labels: LabelMatchers
    """Label matchers every sample must pass."""
    condition: Condition
    """The test on the series."""
    threshold: float | None
    """For ``above`` / ``below``."""
    values: frozenset[float]
    """For ``equals``."""
    mask: int | None
    """For ``bits_any``."""
    min_delta: float
    """Smallest increase that counts (``increased``)."""
    min_rate_per_minute: float | None
    """Smallest increase per minute that counts (``increased``), if set."""
    baseline: str
    """``first`` or ``zero``: what precedes a counter's first sample."""
    for_samples: int
    """Consecutive samples the condition must hold before the rule fires."""
    every_sample: bool
    """Each sample is an event of its own."""
    refire_on_change: bool
    """Fire again when the value changes while the condition holds (a new last-Xid code)."""
    classify_xid: str | None
    """Classify by the Xid log rule of the code in the value or the ``xid`` label."""
    fault_class: FaultClass
    """Class of its findings (fallback when classified by Xid)."""
    severity: Severity
    """Severity of its findings."""
    hardware: bool
    """Whether the node's hardware is at fault."""
    recommended_action: Action
    """Action for one finding."""
    examples: tuple[MetricExample, ...]
    """Series that must fire."""
    counter_examples: tuple[MetricExample, ...]
    """Series that must stay silent."""
    references: tuple[str, ...]
    """Where the examples and thresholds come from."""


@dataclass(frozen=True, slots=True)
class AlertRule:
    """A compiled alert rule."""

    id: str
    """Unique id across all metric and alert packs."""
    pack: str
    """Pack (file stem) it came from."""
    description: str
    """What the alert means."""
    names: frozenset[str]
    """Alert names (lower-cased), also matched against ``condition`` and ``reason`` labels."""
    labels: LabelMatchers
    """Label matchers the alert must pass."""
    xid_labels: tuple[str, ...]
    """Labels that may carry an Xid code (``xid``, dcgm-exporter's ``err_code``)."""
    fault_class: FaultClass
    """Class of its findings."""
    severity: Severity
    """Severity of its findings."""
    hardware: bool
    """Whether the node's hardware is at fault."""
    recommended_action: Action
    """Action for one finding."""
    examples: tuple[dict[str, str], ...]
    """Alert label sets that must match."""
    counter_examples: tuple[dict[str, str], ...]
    """Alert label sets that must not."""
    references: tuple[str, ...]
    """Where the alert names come from."""

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a firing alert with these labels is this rule's."""
        named = any(labels.get(k, "").lower() in self.names for k in ("alertname", "condition", "reason"))
        return named and labels_match(self.labels, labels)


@dataclass(frozen=True, slots=True)
class SignalRules:
    """Every metric and alert rule loaded."""

    metric: tuple[MetricRule, ...] = ()
    """Metric rules, in load order."""
    alert: tuple[AlertRule, ...] = ()
    """Alert rules, in load order."""


def parse_exposition(lines: Iterable[str]) -> list[tuple[str, float, dict[str, str]]]:
    """(name, value, labels) of Prometheus text exposition lines (the exporter's own format)."""
    return [(s.name, s.value, s.labels) for s in exposition_samples("\n".join(lines) + "\n")]


def _matchers(path: str, rid: str, labels: dict[str, str]) -> LabelMatchers:
    out: list[tuple[str, LinearRegex]] = []
    for name, rx in sorted(labels.items()):
        try:
            out.append((name, compile_linear(path, rid, rx)))
        except RuleError as exc:
            raise RuleError(path, rid, f"labels.{name}", exc.problem) from exc
    return tuple(out)


def _metric_rule(path: str, pack: str, spec: MetricRuleSpec) -> MetricRule:
    return MetricRule(
        id=spec.id, pack=pack, description=spec.description, metrics=frozenset(spec.metrics),
        labels=_matchers(path, spec.id, spec.labels), condition=spec.condition, threshold=spec.threshold,
        values=frozenset(spec.values), mask=spec.mask, min_delta=spec.min_delta,
        min_rate_per_minute=spec.min_rate_per_minute, baseline=spec.baseline, for_samples=spec.for_samples,
        every_sample=spec.every_sample, refire_on_change=spec.refire_on_change, classify_xid=spec.classify_xid,
        fault_class=spec.fault_class,
        severity=spec.severity, hardware=spec.hardware, recommended_action=spec.recommended_action,
        examples=spec.examples, counter_examples=spec.counter_examples, references=spec.references,
    )


def _alert_rule(path: str, pack: str, spec: AlertRuleSpec) -> AlertRule:
    rule = AlertRule(
        id=spec.id, pack=pack, description=spec.description, names=frozenset(n.lower() for n in spec.names),
        labels=_matchers(path, spec.id, spec.labels), xid_labels=spec.xid_labels, fault_class=spec.fault_class,
        severity=spec.severity, hardware=spec.hardware, recommended_action=spec.recommended_action,
        examples=spec.examples,
        counter_examples=spec.counter_examples, references=spec.references,
    )
    for i, ex in enumerate(spec.examples):
        if not rule.matches(ex):
            raise RuleError(path, spec.id, f"examples[{i}]", f"does not match: {ex!r}")
    for i, ex in enumerate(spec.counter_examples):
        if rule.matches(ex):
            raise RuleError(path, spec.id, f"counter_examples[{i}]", f"matches: {ex!r}")
    return rule


_Loaded = MetricRule | AlertRule


def _validate(path: str, kind: str, i: int, raw: object, model: type[BaseModel]) -> BaseModel:
    rid = raw.get("id") if isinstance(raw, dict) else None
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or kind
        raise RuleError(path, str(rid or f"{kind}#{i}"), field, first["msg"]) from exc


def load_signal_pack(path: Path) -> list[_Loaded]:
    """Load and validate one metric/alert pack; raises RuleError on the first bad rule."""
    name = str(path)
    try:
        doc = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RuleError(name, None, "<yaml>", str(exc)) from exc
    if not isinstance(doc, dict) or not (set(doc) & {"metric_rules", "alert_rules"}):
        raise RuleError(name, None, "metric_rules", "a pack is a mapping with 'metric_rules' and/or 'alert_rules'")
    unknown = set(doc) - {"metric_rules", "alert_rules"}
    if unknown:
        raise RuleError(name, None, sorted(unknown)[0], "unknown key (expected metric_rules, alert_rules)")
    out: list[_Loaded] = []
    for key in ("metric_rules", "alert_rules"):
        items = doc.get(key) or []
        if not isinstance(items, list):
            raise RuleError(name, None, key, "must be a list")
        for i, raw in enumerate(items):
            if key == "metric_rules":
                mspec = _validate(name, key, i, raw, MetricRuleSpec)
                assert isinstance(mspec, MetricRuleSpec)
                out.append(_metric_rule(name, path.stem, mspec))
            else:
                aspec = _validate(name, key, i, raw, AlertRuleSpec)
                assert isinstance(aspec, AlertRuleSpec)
                out.append(_alert_rule(name, path.stem, aspec))
    return out


def load_signal_rules(paths: Iterable[Path]) -> SignalRules:
    """Metric and alert packs from files or directories; ids unique; every example replayed."""
    from analyzer.metric_eval import check_examples  # the evaluator imports this module's records

    loaded, seen = load_packs(paths, load_signal_pack)
    metric = tuple(r for r in loaded if isinstance(r, MetricRule))
    for rule in metric:
        check_examples(seen[rule.id], rule)
    return SignalRules(metric=metric, alert=tuple(r for r in loaded if isinstance(r, AlertRule)))
