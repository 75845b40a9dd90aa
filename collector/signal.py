"""Signal: one observation from one node, the record the collector stage produces."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Source(StrEnum):
    """Where on the node a signal came from."""

    KERNEL = "kernel"
    CONTAINER = "container"
    NVML = "nvml"
    DCGM = "dcgm"
    IB = "ib"
    ALERT = "alert"
    PROGRESS = "progress"


@dataclass(frozen=True, slots=True)
class LogLine:
    """A line of text from the kernel log or a container log."""

    text: str
    """The line itself, without trailing newline or CRI prefix."""
    namespace: str | None = None
    """Kubernetes namespace of the pod that wrote it (container logs only)."""
    pod: str | None = None
    """Pod name (container logs only)."""
    container: str | None = None
    """Container name inside the pod (container logs only)."""
    job: str | None = None
    """Training job the pod belongs to, from pod labels, if known."""
    rank: int | None = None
    """Global rank of the process that wrote the line, if known."""


@dataclass(frozen=True, slots=True)
class MetricSample:
    """One sample of a numeric metric (NVML, DCGM, IB counters, alerts)."""

    name: str
    """Metric name, e.g. ``DCGM_FI_DEV_XID_ERRORS`` or ``ib_link_downed``."""
    value: float
    """Sample value."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels such as ``gpu`` index, ``pci`` bus id, ``device``/``port`` of a NIC."""


@dataclass(frozen=True, slots=True)
class ProgressSample:
    """Training progress reported by one rank of one job."""

    job: str
    """Training job name."""
    rank: int
    """Global rank."""
    step: int
    """Optimizer step (iteration) just completed."""
    step_time: float | None = None
    """Seconds the step took, if the trainer reports it."""
    phases: Mapping[str, float] = field(default_factory=dict)
    """Optional per-phase seconds (forward, backward, optimizer, comm_wait)."""
    event: str = "step"
    """``step`` (`step` finished), ``end`` (the run finished), ``exit`` (the rank's container is gone) or ``start``
    (the rank's process was seen running: the job exists before its first progress line)."""
    world_size: int | None = None
    """Ranks in the run (torchrun's ``WORLD_SIZE``), when the reporter knows it: a change is a new run."""
    namespace: str | None = None
    """Kubernetes namespace of the job's pods, when known (older agents send none): it is part of the job's identity."""
    samples: int = 1
    """Steps this record stands for: 1 for one step's sample, more for an agent's window summary (then ``step``
    is the window's last step, ``step_time`` and ``phases`` their means over the window)."""
    step_time_min: float | None = None
    """Fastest step time in a summary's window (None for a single sample)."""
    step_time_max: float | None = None
    """Slowest step time in a summary's window (None for a single sample)."""
    arrivals: tuple[tuple[int, float, float | None], ...] = ()
    """For a summary of step lines: (step, time, step time) of the window's steps, thinned to at most
    ``MAX_ARRIVALS`` on steps that are multiples of a power of two, so other nodes' summaries share them. The
    service reads them as the lines they stand for (the arrival lag that names a slow rank compares ranks
    at equal steps). A summary of the hook's samples lists them too (each report's time and step time)."""
    phases_sd: Mapping[str, float] = field(default_factory=dict)
    """For a summary of the hook's samples: each phase's standard deviation over the window's steps (how steady
    the rank's own work was; CPU contention makes every rank's unsteady, a slow rank's stays steady and higher)."""
    phases_peak: Mapping[str, float] = field(default_factory=dict)
    """For a summary of the hook's samples: each phase's largest seconds in the window (its slowest step, which the
    service sets aside: one hiccup is not how the rank's steps go)."""


MAX_ARRIVALS = 64
"""Most steps a summary lists in ``arrivals`` (the detectors keep 64 per rank)."""

Payload = LogLine | MetricSample | ProgressSample


@dataclass(frozen=True, slots=True)
class Signal:
    """One observation from one node with a stable id, so redelivery is harmless."""

    id: str
    """Stable id: node + source + file identity + offset (or sequence)."""
    node: str
    """Kubernetes node name the observation is about."""
    source: Source
    """Which source produced it."""
    ts: float
    """Observation time, seconds since the Unix epoch."""
    payload: Payload
    """Exactly one of a log line, a metric sample or a progress sample."""
    sent_ts: float | None = None
    """The time the sender stamped, when it was too far ahead of the receiver's clock (``ts`` is then the
    receiver's time); None otherwise."""

    @property
    def text(self) -> str | None:
        """The log text when the payload is a log line, else ``None``."""
        return self.payload.text if isinstance(self.payload, LogLine) else None


class DecodedBatch(tuple[Signal, ...]):
    """A batch of signals as a decoder built them, with the texts of its log lines taken on the way.

    The decoder holds each text while it builds the signal; the rule engine reads the texts from here
    instead of walking the batch's objects a second time (on a large batch that walk costs as much as
    scanning the text). A tuple, so the batch cannot change after the texts were taken; a slice or a copy
    is a plain sequence and is read the ordinary way.
    """

    texts: tuple[str, ...]
    """The texts of the batch's log-line signals (``logs``), in order."""
    _logs: Sequence[Signal] | None
    """The log-line signals when the batch holds anything else; None when every signal is one."""

    def __new__(cls, signals: Iterable[Signal], texts: Iterable[str], *,
                logs: Sequence[Signal] | None = None) -> DecodedBatch:
        """``logs``: the batch's log-line signals when it holds anything else (None: every signal is one)."""
        batch = super().__new__(cls, signals)
        batch._logs = logs
        batch.texts = tuple(texts)
        if len(batch.texts) != len(batch.logs):
            raise ValueError(f"{len(batch.texts)} texts for {len(batch.logs)} log signals")
        return batch

    @property
    def logs(self) -> Sequence[Signal]:
        """The batch's log-line signals, in order (the batch itself when it holds nothing else)."""
        return self if self._logs is None else self._logs
