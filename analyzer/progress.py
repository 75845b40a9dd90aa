"""Progress extraction: log lines and progress samples in, ProgressEvent records out (pure).

Two ways progress arrives: a trainer's own log lines (matched by ``rules/progress``)
and the optional hook (``collector.progress_hook``) whose samples come in as
``progress`` signals. Both become the same record, which the detectors consume.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from analyzer.progress_rules import ProgressKind, ProgressRule
from collector.signal import LogLine, ProgressSample, Signal

_RANK_PREFIX = re.compile(r"^\[(?:rank|Rank |RANK )(\d+)\]")
"""torchrun's ``--tee``/log-prefix form (``[rank3]: ...``); also DeepSpeed's ``[Rank 0]`` is a log field, not this."""

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


class ProgressExtractor:
    """Turns signals into progress events; keeps a counter for formats that print no step number."""

    def __init__(self, rules: Sequence[ProgressRule]) -> None:
        self.rules = tuple(sorted(rules, key=lambda r: r.priority))
        self._counters: dict[tuple[str, int, str], int] = {}

    def extract(self, signals: Sequence[Signal]) -> list[ProgressEvent]:
        """Progress events found in a batch, in signal order."""
        out: list[ProgressEvent] = []
        for sig in signals:
            p = sig.payload
            if isinstance(p, ProgressSample):
                out.append(ProgressEvent(job=p.job, rank=p.rank, node=sig.node, ts=sig.ts, kind=_KINDS[p.event],
                                         step=p.step, step_time=p.step_time, phases=dict(p.phases),
                                         signal_id=sig.id))
            elif isinstance(p, LogLine) and self.rules:
                ev = self._from_line(sig, p)
                if ev is not None:
                    out.append(ev)
        return out

    def _from_line(self, sig: Signal, line: LogLine) -> ProgressEvent | None:
        text = line.text
        for rule in self.rules:
            got = rule.extract(text)
            if got is None:
                continue
            job = line.job or (f"{line.namespace}/{line.pod}" if line.pod else None)
            if job is None:
                return None  # progress of an unknown job cannot be compared with anything
            rank = line.rank if line.rank is not None else got.rank
            if rank is None:
                m = _RANK_PREFIX.match(text)
                rank = int(m.group(1)) if m else -1
            step = got.step
            if step is None and rule.kind is ProgressKind.STEP:
                key = (job, rank, rule.id)
                step = self._counters.get(key, 0) + 1
                self._counters[key] = step
            return ProgressEvent(job=job, rank=rank, node=sig.node, ts=sig.ts, kind=rule.kind, step=step,
                                 total=got.total, step_time=got.step_time, signal_id=sig.id, rule_id=rule.id)
        return None
