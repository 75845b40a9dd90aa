"""Progress-extraction rules: YAML data (``rules/progress/*.yaml``) compiled into typed records.

Each rule turns a trainer's log line into a step (or a pause/resume marker). Like the
fault rule packs, every rule carries real example lines, here with the values it must
extract, and a bad rule fails at load with its file, rule id and field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from analyzer.packs import default_progress_rules_dir as default_progress_rules_dir
from analyzer.rules import LinearRegex, RuleError, check_urls, compile_linear, load_packs, load_yaml


class ProgressKind(StrEnum):
    """What a progress line says about the job."""

    STEP = "step"
    """A training step (iteration) completed."""
    PAUSE = "pause"
    """A planned pause started (checkpoint write, evaluation pass): no steps for a while is fine."""
    RESUME = "resume"
    """The planned pause ended; the stall clock restarts here."""
    END = "end"
    """The run finished (the trainer's end-of-training line, the hook's ``finish()``): silence is no hang."""
    EXIT = "exit"
    """The rank's container is gone (reported by the collector, never matched by a rule)."""
    START = "start"
    """The rank's process was seen running (reported by the collector, never matched by a rule)."""


GROUPS = frozenset({"step", "total", "step_time_ms", "step_time_s", "s_per_it", "it_per_s", "rank", "epoch", "tps"})
"""Named groups a progress pattern may use; anything else is refused at load."""



class ExampleSpec(BaseModel):
    """A real line and what the rule must extract from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    line: str
    step: int | None = None
    total: int | None = None
    step_time: float | None = Field(default=None, description="seconds")


class ProgressRuleSpec(BaseModel):
    """A progress rule as written in YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    description: str
    kind: ProgressKind
    contains: str = Field(min_length=1, description="literal that every matching line contains (fast pre-filter)")
    pattern: str
    examples: tuple[ExampleSpec, ...] = Field(min_length=1)
    counter_examples: tuple[str, ...] = ()
    references: tuple[str, ...] = Field(min_length=1)

    @field_validator("references")
    @classmethod
    def _urls(cls, refs: tuple[str, ...]) -> tuple[str, ...]:
        return check_urls(refs)


@dataclass(frozen=True, slots=True)
class Extracted:
    """Values one progress rule pulled out of one line."""

    step: int | None
    """Step number, or None when the format has none (each line then counts as one interval)."""
    total: int | None
    """Total steps the run will do, when printed (a run at its last step is finished, not hung)."""
    step_time: float | None
    """Seconds per step, when printed."""
    rank: int | None
    """Rank named in the line itself, if any."""
    epoch: int | None = None
    """Epoch, for formats whose step restarts every epoch (the extractor makes it monotonic)."""


@dataclass(frozen=True, slots=True)
class ProgressRule:
    """A compiled progress rule."""

    id: str
    """Unique id across all progress packs."""
    pack: str
    """Pack (file stem) it came from."""
    kind: ProgressKind
    """Step, pause or resume."""
    contains: str
    """Literal every matching line contains; lines without it are skipped without running the regex."""
    regex: LinearRegex
    """Compiled pattern."""
    priority: int
    """Lower is tried first (trainer-specific packs before the generic one)."""
    references: tuple[str, ...]
    """Where the examples come from."""

    def extract(self, text: str) -> Extracted | None:
        """The values in `text`, or None when the rule does not match it."""
        if self.contains not in text:
            return None
        m = self.regex.search(text)
        if m is None:
            return None
        return self.values(m.groupdict())

    def values(self, g: Mapping[str, str | None]) -> Extracted:
        """What the pattern's named groups read (a group that took no part is None)."""
        epoch = g.get("epoch")
        return Extracted(step=_int(g.get("step")), total=_int(g.get("total")), step_time=_step_time(g),
                         rank=_int(g.get("rank")), epoch=int(epoch) if epoch and epoch.isdigit() else None)


def _int(raw: str | None) -> int | None:
    return int(raw.replace(",", "")) if raw else None


def _step_time(g: Mapping[str, str | None]) -> float | None:
    if g.get("step_time_ms"):
        return float(g["step_time_ms"] or 0) / 1000.0
    if g.get("step_time_s"):
        return float(g["step_time_s"] or 0)
    if g.get("s_per_it"):
        return float(g["s_per_it"] or 0)
    rate = g.get("it_per_s")
    if rate and float(rate) > 0:
        return 1.0 / float(rate)
    return None


def _compile(path: str, spec: ProgressRuleSpec) -> LinearRegex:
    regex = compile_linear(path, spec.id, spec.pattern)
    unknown = set(regex.groupindex) - GROUPS
    if unknown:
        raise RuleError(path, spec.id, "pattern", f"unknown named groups {sorted(unknown)}; allowed: {sorted(GROUPS)}")
    return regex


def _check_example(path: str, rule: ProgressRule, i: int, ex: ExampleSpec) -> None:
    got = rule.extract(ex.line)
    if got is None:
        raise RuleError(path, rule.id, f"examples[{i}]", f"does not match: {ex.line!r}")
    for name in ("step", "total"):
        want = getattr(ex, name)
        if want is not None and getattr(got, name) != want:
            raise RuleError(path, rule.id, f"examples[{i}].{name}", f"extracted {getattr(got, name)!r}, want {want!r}")
    if ex.step_time is not None and (got.step_time is None or not math.isclose(got.step_time, ex.step_time,
                                                                                  rel_tol=1e-6)):
        raise RuleError(path, rule.id, f"examples[{i}].step_time",
                        f"extracted {got.step_time!r}, want {ex.step_time!r}")


def load_progress_pack(path: Path) -> list[ProgressRule]:
    """Load and validate one progress pack; raises RuleError on the first bad rule."""
    name = str(path)
    try:
        doc = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RuleError(name, None, "<yaml>", str(exc)) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise RuleError(name, None, "rules", "a pack is a mapping with a 'rules' list")
    priority = doc.get("priority", 100)
    if not isinstance(priority, int):
        raise RuleError(name, None, "priority", "must be an integer")
    out: list[ProgressRule] = []
    for i, raw in enumerate(doc["rules"]):
        rid = raw.get("id") if isinstance(raw, dict) else None
        try:
            spec = ProgressRuleSpec.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise RuleError(name, rid or f"#{i}", ".".join(str(p) for p in first["loc"]), first["msg"]) from exc
        rule = ProgressRule(id=spec.id, pack=path.stem, kind=spec.kind, contains=spec.contains,
                            regex=_compile(name, spec), priority=priority, references=spec.references)
        for j, ex in enumerate(spec.examples):
            _check_example(name, rule, j, ex)
        for j, line in enumerate(spec.counter_examples):
            if rule.extract(line) is not None:
                raise RuleError(name, rule.id, f"counter_examples[{j}]", f"matches: {line!r}")
        out.append(rule)
    return out


def load_progress_rules(paths: Iterable[Path]) -> list[ProgressRule]:
    """Load progress packs from files or directories; ids must be unique. Sorted by priority, then load order."""
    rules, _ = load_packs(paths, load_progress_pack)
    return sorted(rules, key=lambda r: r.priority)
