"""Progress extraction: log lines and progress samples in, ProgressEvent records out (pure).

Two ways progress arrives: a trainer's own log lines (matched by ``rules/progress``)
and the optional hook (``collector.progress_hook``) whose samples come in as
``progress`` signals. Both become the same record, which the detectors consume.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from analyzer.progress_rules import Extracted, ProgressKind, ProgressRule
from collector.identity import line_rank, strip_rank_prefix
from collector.signal import LogLine, ProgressSample, Signal

_KINDS = {"step": ProgressKind.STEP, "end": ProgressKind.END, "exit": ProgressKind.EXIT}
"""A progress sample's event to the event kind."""


@dataclass(frozen=True, slots=True)
class ProgressEvent:
    """One progress observation of one rank of one job."""

    job: str
    """Training job name."""
    rank: int
    """Global rank; -1 when the line names no rank (a job that logs from one process only)."""
    node: str
    """Node the rank runs on."""
    ts: float
    """When it was observed, seconds since the Unix epoch."""
    kind: ProgressKind
    """Step completed, planned pause started, or pause ended."""
    step: int | None
    """Step number (None for pause markers that name none)."""
    total: int | None = None
    """Total steps of the run, when the trainer prints it."""
    step_time: float | None = None
    """Seconds per step as reported by the trainer (Megatron averages over its log interval)."""
    phases: Mapping[str, float] = field(default_factory=dict)
    """Per-phase seconds from the hook (forward, backward, optimizer, comm_wait...)."""
    signal_id: str = ""
    """The signal it came from (evidence)."""
    rule_id: str = "hook"
    """Progress rule that matched, or ``hook`` for samples from the training-script hook."""
    world_size: int | None = None
    """Ranks in the run, when the reporter said (the hook records torchrun's ``WORLD_SIZE``)."""


def match_progress(text: str, rules: Sequence[ProgressRule]) -> tuple[ProgressRule, Extracted] | None:
    """The first rule (in priority order) that reads progress from a line, and what it read.

    A bar redraws itself with carriage returns inside one line: the latest redraw counts. A
    launcher's rank prefix is taken off first, so anchored patterns see the trainer's own text.
    """
    segments = reversed(text.split("\r")) if "\r" in text else (text,)
    for seg in segments:
        body = strip_rank_prefix(seg)
        for rule in rules:
            got = rule.extract(body)
            if got is not None:
                return rule, got
    return None


class LiteralFilter:
    """Which rules a batch's lines could match, from each rule's ``contains`` literal, found batch-wide.

    Trying every rule on every line costs one Python call per rule and line (about 20 per line).
    Instead the lines are joined once and each distinct literal is searched in the joined text
    (``str.find``, C speed); a line is offered only the rules whose literal it holds, in priority
    order. A literal in a line's text is necessary for it to be in any segment of that line, so no
    match is lost. A literal holding a newline could straddle two joined lines: such rules are
    offered to every line.
    """

    def __init__(self, rules: Sequence[ProgressRule]) -> None:
        self.rules = tuple(rules)
        by_literal: dict[str, list[int]] = {}
        self._always: tuple[int, ...] = ()
        for i, rule in enumerate(self.rules):
            if "\n" in rule.contains:
                self._always += (i,)
            else:
                by_literal.setdefault(rule.contains, []).append(i)
        self._literals = tuple((lit, tuple(ix)) for lit, ix in by_literal.items())

    def candidates(self, texts: Sequence[str]) -> dict[int, tuple[ProgressRule, ...]]:
        """Line index → the rules (priority order) whose literal that line holds; lines with none are absent."""
        if not texts:
            return {}
        joined = "\n".join(texts)
        starts = [0, *accumulate(len(t) + 1 for t in texts)]  # starts[i]: offset of line i; last: past the end
        hits: dict[int, list[int]] = {}
        if self._always:
            hits = {i: list(self._always) for i in range(len(texts))}
        find = joined.find
        for lit, ixs in self._literals:
            at = find(lit)
            while at >= 0:
                line = bisect_right(starts, at) - 1
                hits.setdefault(line, []).extend(ixs)
                at = find(lit, starts[line + 1])  # the next line: one hit per line is enough
        rules = self.rules
        return {line: tuple(rules[i] for i in sorted(ixs)) for line, ixs in hits.items()}


class ProgressExtractor:
    """Turns signals into progress events; keeps a counter for formats that print no step number."""

    def __init__(self, rules: Sequence[ProgressRule]) -> None:
        self.rules = tuple(sorted(rules, key=lambda r: r.priority))
        self._filter = LiteralFilter(self.rules)
        self._counters: dict[tuple[str, int, str], int] = {}
        self._epochs: dict[tuple[str, int, str], tuple[int, int, int]] = {}

    def forget(self, job: str) -> None:
        """Drop the step counters of a job that left the book."""
        for kept in (self._counters, self._epochs):
            for key in [k for k in kept if k[0] == job]:
                del kept[key]

    def extract(self, signals: Sequence[Signal]) -> list[ProgressEvent]:
        """Progress events found in a batch, in signal order."""
        lines = [i for i, sig in enumerate(signals) if isinstance(sig.payload, LogLine)] if self.rules else []
        offered = self._filter.candidates([signals[i].payload.text for i in lines])  # type: ignore[union-attr]
        line_rules = {lines[k]: rules for k, rules in offered.items()}
        out: list[ProgressEvent] = []
        for i, sig in enumerate(signals):
            p = sig.payload
            if isinstance(p, ProgressSample):
                out.append(ProgressEvent(job=p.job, rank=p.rank, node=sig.node, ts=sig.ts, kind=_KINDS[p.event],
                                         step=p.step, step_time=p.step_time, phases=dict(p.phases),
                                         signal_id=sig.id, world_size=p.world_size))
            elif i in line_rules:
                assert isinstance(p, LogLine)
                found = match_progress(p.text, line_rules[i])
                ev = self._event(sig, p, *found) if found is not None else None
                if ev is not None:
                    out.append(ev)
        return out

    def _event(self, sig: Signal, line: LogLine, rule: ProgressRule, got: Extracted) -> ProgressEvent | None:
        job = line.job or (f"{line.namespace}/{line.pod}" if line.pod else None)
        if job is None:
            return None  # progress of an unknown job cannot be compared with anything
        rank = line.rank if line.rank is not None else got.rank
        if rank is None:
            named = line_rank(line.text)
            rank = named if named is not None else -1
        step = got.step
        key = (job, rank, rule.id)
        if step is None and rule.kind is ProgressKind.STEP:
            step = self._counters.get(key, 0) + 1
            self._counters[key] = step
        elif step is not None and got.epoch is not None:
            step = self._through_epochs(key, got.epoch, step)
        return ProgressEvent(job=job, rank=rank, node=sig.node, ts=sig.ts, kind=rule.kind, step=step,
                             total=None if got.epoch is not None else got.total, step_time=got.step_time,
                             signal_id=sig.id, rule_id=rule.id)

    def _through_epochs(self, key: tuple[str, int, str], epoch: int, step: int) -> int:
        """A step that restarts every epoch, made monotonic: the steps of earlier epochs are added.

        The total printed with such a step is the epoch's, not the run's, so it is not passed on.
        """
        last_epoch, base, top = self._epochs.get(key, (epoch, 0, 0))
        if epoch > last_epoch:
            base, top = base + top, 0
        elif epoch < last_epoch:
            base, top = 0, 0  # an earlier epoch again: the run restarted
        top = max(top, step)
        self._epochs[key] = (epoch, base, top)
        return base + step
