"""Progress extraction: log lines and progress samples in, ProgressEvent records out (pure).

Two ways progress arrives: a trainer's own log lines (matched by ``rules/progress``)
and the optional hook (``collector.progress_hook``) whose samples come in as
``progress`` signals. Both become the same record, which the detectors consume.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from analyzer.progress_rules import Extracted, ProgressKind, ProgressRule
from collector.identity import line_rank, strip_rank_prefix
from collector.signal import LogLine, ProgressSample, Signal

_KINDS = {"step": ProgressKind.STEP, "end": ProgressKind.END, "exit": ProgressKind.EXIT,
          "start": ProgressKind.START}
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
    namespace: str | None = None
    """Kubernetes namespace of the job, when known: ``train`` in two namespaces is two jobs."""
    counted: bool = False
    """`step` was counted from lines that number no step (a Trainer's loss dict), not printed: it is no
    measure of a rank that also prints numbered steps (its progress bar)."""
    samples: int = 1
    """Steps `phases` stand for: an agent's summary of hook reports gives its window's mean phases with its last
    step."""
    phases_sd: Mapping[str, float] = field(default_factory=dict)
    """With `samples` > 1: each phase's standard deviation over those steps."""
    phases_peak: Mapping[str, float] = field(default_factory=dict)
    """With `samples` > 1: each phase's largest seconds in those steps."""

    @property
    def key(self) -> str:
        """The job's identity, which detectors key their state by: ``namespace/job``, or the bare name."""
        return f"{self.namespace}/{self.job}" if self.namespace else self.job


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


class ProgressMatcher:
    """Same answer as :func:`match_progress`, with one combined prefilter instead of every rule on every line.

    All rules' patterns are one RE2 set: a single pass over a line says which rules' patterns match it,
    and only those (in priority order) extract. A line that matches no rule, nearly every line a
    trainer prints, costs that one pass. Linear in the line, as every rule is.
    """

    def __init__(self, rules: Sequence[ProgressRule]) -> None:
        import re2

        self.rules = tuple(sorted(rules, key=lambda r: r.priority))
        opts = re2.Options()
        opts.log_errors = False
        self._set: Any = re2.Set.SearchSet(opts)
        self._rule_of: dict[int, int] = {}
        self._always: tuple[int, ...] = ()
        always: list[int] = []
        for i, rule in enumerate(self.rules):
            try:
                self._rule_of[self._set.Add(rule.regex.pattern)] = i
            except re2.error:
                always.append(i)  # a pattern the set refuses is simply tried on every line
        self._always = tuple(always)
        if self._rule_of:
            self._set.Compile()
        # Where the installed RE2 exposes its compiled Match (every group's span in one call), an ASCII line
        # is read through it: a fifth of the cost of the wrapper's search() and groupdict().
        anchor = getattr(getattr(getattr(re2, "_re2", None), "RE2", None), "Anchor", None)
        self._spans: list[tuple[Callable[[bytes, int, int], list[tuple[int, int]]], tuple[tuple[str, int], ...]]
                          | None] = []
        for rule in self.rules:
            compiled = re2.compile(rule.regex.pattern.encode("utf-8"), options=opts)
            match = getattr(getattr(compiled, "_regexp", None), "Match", None)
            names = tuple(sorted(rule.regex.groupindex.items(), key=lambda kv: kv[1]))
            self._spans.append((functools.partial(match, anchor.UNANCHORED), names)
                               if match is not None and anchor is not None else None)

    def candidates(self, body: str) -> list[int]:
        """Indices (priority order) of the rules whose pattern matches somewhere in ``body``."""
        found = [self._rule_of[k] for k in self._set.Match(body) or ()] if self._rule_of else []
        if self._always:
            found.extend(self._always)
        found.sort()
        return found

    def match(self, text: str) -> tuple[ProgressRule, Extracted] | None:
        """The first rule (in priority order) that reads progress from a line, and what it read."""
        segments = reversed(text.split("\r")) if "\r" in text else (text,)
        for seg in segments:
            body = strip_rank_prefix(seg)
            for i in self.candidates(body):
                got = self._extract(i, body)
                if got is not None:
                    return self.rules[i], got
        return None

    def _extract(self, i: int, body: str) -> Extracted | None:
        rule, fast = self.rules[i], self._spans[i]
        if fast is None or not body.isascii():
            return rule.extract(body)
        if rule.contains not in body:
            return None
        data = body.encode("ascii")
        spans = fast[0](data, 0, len(data))
        if spans[0][0] < 0:
            return None
        return rule.values({name: data[span[0]:span[1]].decode("ascii") if (span := spans[idx])[0] >= 0 else None
                            for name, idx in fast[1]})


class ProgressExtractor:
    """Turns signals into progress events; keeps a counter for formats that print no step number."""

    def __init__(self, rules: Sequence[ProgressRule]) -> None:
        self.rules = tuple(sorted(rules, key=lambda r: r.priority))
        self._matcher = ProgressMatcher(self.rules)
        self._counters: dict[tuple[str, int, str], int] = {}
        self._epochs: dict[tuple[str, int, str], tuple[int, int, int]] = {}

    def forget(self, job: str) -> None:
        """Drop the step counters of a job (by its key) that left the book."""
        for kept in (self._counters, self._epochs):
            for key in [k for k in kept if k[0] == job]:
                del kept[key]

    def extract(self, signals: Sequence[Signal]) -> list[ProgressEvent]:
        """Progress events found in a batch, in signal order."""
        out: list[ProgressEvent] = []
        for sig in signals:
            p = sig.payload
            if isinstance(p, ProgressSample) and p.arrivals:
                out.extend(_arrivals(sig, p))
            elif isinstance(p, ProgressSample):
                out.append(ProgressEvent(job=p.job, rank=p.rank, node=sig.node, ts=sig.ts, kind=_KINDS[p.event],
                                         step=p.step, step_time=p.step_time, phases=dict(p.phases),
                                         signal_id=sig.id, world_size=p.world_size, namespace=p.namespace))
            elif isinstance(p, LogLine) and self.rules:
                ev = self._from_line(sig, p)
                if ev is not None:
                    out.append(ev)
        return out

    def edge_step(self, line: LogLine) -> ProgressSample | bool:
        """A log line's step as a sample the node agent may summarise, or whether the line is progress at all.

        A sample for a step line that numbers its step itself, of a known job, short of the run's printed
        total. True for any other progress line (a counted or per-epoch step, a pause, the end, the run's last
        step with its total), which the service must read itself: its counters and markers stay there. False:
        no progress rule matches.
        """
        found = self._matcher.match(line.text)
        if found is None:
            return False
        rule, got = found
        job = line.job or line.pod
        if (rule.kind is not ProgressKind.STEP or got.step is None or got.epoch is not None or job is None
                or (got.total is not None and got.step >= got.total)):
            return True
        rank = line.rank if line.rank is not None else got.rank
        if rank is None:
            rank = line_rank(line.text)
            if rank is None:
                return True  # no rank: the service keeps such a job's lines apart
        return ProgressSample(job=job, rank=rank, step=got.step, step_time=got.step_time,
                              namespace=line.namespace or None)

    def _from_line(self, sig: Signal, line: LogLine) -> ProgressEvent | None:
        found = self._matcher.match(line.text)
        return self._event(sig, line, *found) if found is not None else None

    def _event(self, sig: Signal, line: LogLine, rule: ProgressRule, got: Extracted) -> ProgressEvent | None:
        job = line.job or line.pod
        if job is None:
            return None  # progress of an unknown job cannot be compared with anything
        # A pod with no job label is its own job, named by the pod in its namespace.
        namespace = line.namespace or None
        rank = line.rank if line.rank is not None else got.rank
        if rank is None:
            named = line_rank(line.text)
            rank = named if named is not None else -1
        step = got.step
        key = (f"{namespace}/{job}" if namespace else job, rank, rule.id)
        counted = step is None and rule.kind is ProgressKind.STEP
        if counted:
            step = self._counters.get(key, 0) + 1
            self._counters[key] = step
        elif step is not None and got.epoch is not None:
            step = self._through_epochs(key, got.epoch, step)
        return ProgressEvent(job=job, rank=rank, node=sig.node, ts=sig.ts, kind=rule.kind, step=step,
                             total=None if got.epoch is not None else got.total, step_time=got.step_time,
                             signal_id=sig.id, rule_id=rule.id, namespace=namespace, counted=counted)

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


def _arrivals(sig: Signal, p: ProgressSample) -> list[ProgressEvent]:
    """A summary of step lines or hook reports as the step events they gave; a hook summary's mean phases (and
    their spread) go with its last step, standing for all its steps."""
    out = []
    for step, ts, step_time in p.arrivals:
        last = step == p.step and bool(p.phases)
        out.append(ProgressEvent(job=p.job, rank=p.rank, node=sig.node, ts=ts, kind=ProgressKind.STEP, step=step,
                                 step_time=step_time, signal_id=sig.id, rule_id="summary", world_size=p.world_size,
                                 namespace=p.namespace, phases=dict(p.phases) if last else {},
                                 samples=p.samples if last else 1, phases_sd=dict(p.phases_sd) if last else {},
                                 phases_peak=dict(p.phases_peak) if last else {}))
    return out
