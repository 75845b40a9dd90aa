"""What one replica's batch gives the correlating leader: rule findings, job placements, progress (pure).

With several replicas on one database, each replica matches its own agents' batches (rules and metric
series are per node), and only the Lease holder correlates, escalates and runs the detectors. A batch
is reduced to this digest; the leader folds digests in the order the database gives them.
"""

from __future__ import annotations

from dataclasses import dataclass

from analyzer.detectors.book import METRIC_FEATURES
from analyzer.detectors.flight_recorder import Dump
from analyzer.detectors.stacks import StackSample
from analyzer.progress import ProgressEvent
from analyzer.records import Finding
from collector.signal import MetricSample, Signal
from collector.survey import METRIC as SURVEY_METRIC


@dataclass(frozen=True, slots=True)
class StackReport:
    """One rank's Python stack, taken by the node agent on a suspected hang, for the leader's detectors."""

    job: str
    """Training job name."""
    sample: StackSample
    """The stack."""
    ts: float
    """When the receiving replica took it."""


@dataclass(frozen=True, slots=True)
class DumpReport:
    """One rank's Flight Recorder dump, checked by the receiving replica, for the leader's detector."""

    job: str
    """Training job name."""
    rank: int
    """Global rank that wrote it."""
    node: str
    """Node it came from."""
    dump: Dump
    """The checked dump."""
    ts: float
    """When the receiving replica took it."""
    source: str
    """Evidence id."""


@dataclass(frozen=True, slots=True)
class BatchDigest:
    """One ingested batch, reduced to what correlation and the detectors need."""

    findings: tuple[Finding, ...]
    """Rule and metric findings of the batch, before escalation (the leader counts rates fleet-wide)."""
    placements: tuple[tuple[str, str], ...]
    """(job, node) pairs the batch shows."""
    placed_at: float
    """The batch's newest signal time: when those placements were seen."""
    progress: tuple[ProgressEvent, ...]
    """Progress events read from the batch's lines and samples, in signal order."""
    metrics: tuple[Signal, ...]
    """The metric samples the detectors read (GPU and NIC features), others left out."""
    newest: float
    """The batch's newest signal time (the detectors' watermark); 0 for an empty batch."""
    stacks: tuple[StackReport, ...] = ()
    """Stack dumps the replica received (not from a signal batch)."""
    dumps: tuple[DumpReport, ...] = ()
    """Flight Recorder dumps the replica received."""

    @property
    def empty(self) -> bool:
        """Nothing for the leader: no row needs to be written."""
        return not (self.findings or self.placements or self.progress or self.metrics or self.stacks or self.dumps)


def detector_metrics(signals: list[Signal]) -> tuple[Signal, ...]:
    """The samples a detector reads (``METRIC_FEATURES``); the rest stay with the replica's metric rules."""
    return tuple(s for s in signals if isinstance(s.payload, MetricSample)
                 and (s.payload.name in METRIC_FEATURES or s.payload.name == SURVEY_METRIC))
