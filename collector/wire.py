"""JSON wire format of signal batches (``POST /v1/signals``), shared by agent and service.

Pydantic lives here because this is a boundary: a malformed batch is rejected whole
and the error names the field (``signals.3.payload.text``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from collector.signal import MAX_ARRIVALS, LogLine, MetricSample, ProgressSample, Signal, Source
from collector.validate import MAX_NODE_NAME, NODE_NAME_PATTERN

# Checked by pydantic-core's own regex engine (no Python call per field): the service path parses
# thousands of signals per batch.
Text = Annotated[str, Field(pattern=r"^[^\x00]*$")]
"""Text any store can hold (PostgreSQL text cannot hold NUL)."""
NodeName = Annotated[str, Field(min_length=1, max_length=MAX_NODE_NAME, pattern=NODE_NAME_PATTERN)]
"""A Kubernetes node name (DNS-1123 subdomain, labels of at most 63 characters)."""


class _Strict(BaseModel):
    # Numbers must be finite: JSON's Infinity/NaN (or 1e309) would reach the store as null times.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LogPayload(_Strict):
    """A log line on the wire."""

    kind: Literal["log"] = "log"
    text: Text = Field(max_length=65536)
    namespace: Text | None = Field(default=None, max_length=253)
    pod: Text | None = Field(default=None, max_length=253)
    container: Text | None = Field(default=None, max_length=253)
    job: Text | None = Field(default=None, max_length=253)
    rank: int | None = Field(default=None, ge=0)


class MetricPayload(_Strict):
    """A metric sample on the wire."""

    kind: Literal["metric"] = "metric"
    name: Text = Field(min_length=1, max_length=256)
    value: float
    labels: dict[Text, Text] = Field(default_factory=dict, max_length=64)


class ProgressPayload(_Strict):
    """A progress sample on the wire."""

    kind: Literal["progress"] = "progress"
    job: Text = Field(min_length=1, max_length=253)
    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    step_time: float | None = Field(default=None, ge=0)
    phases: dict[Text, float] = Field(default_factory=dict, max_length=64)
    event: Literal["step", "end", "exit", "start"] = "step"
    world_size: int | None = Field(default=None, ge=1, le=1_000_000)
    namespace: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[^\x00/]+$")] | None = None
    """The job's namespace (part of its identity); older agents send none."""
    samples: int = Field(default=1, ge=1, le=1_000_000)
    step_time_min: float | None = Field(default=None, ge=0)
    step_time_max: float | None = Field(default=None, ge=0)
    arrivals: list[tuple[Annotated[int, Field(ge=0)], float, Annotated[float, Field(ge=0)] | None]] = Field(
        default_factory=list, max_length=MAX_ARRIVALS)
    """A step-line summary's (step, time, step time) of its window's steps (older agents send none)."""
    phases_sd: dict[Text, Annotated[float, Field(ge=0)]] = Field(default_factory=dict, max_length=64)
    """A hook summary's per-phase standard deviation over its window's steps (older agents send none)."""
    phases_peak: dict[Text, float] = Field(default_factory=dict, max_length=64)
    """A hook summary's per-phase largest seconds in its window (older agents send none)."""


PayloadIn = Annotated[LogPayload | MetricPayload | ProgressPayload, Field(discriminator="kind")]


class SignalIn(_Strict):
    """One signal on the wire."""

    id: Text = Field(min_length=1, max_length=512)
    node: NodeName
    source: Source
    ts: float = Field(gt=0)
    payload: PayloadIn


class SignalBatch(_Strict):
    """A batch of signals; accepted or rejected as a whole."""

    signals: list[SignalIn] = Field(max_length=50000)
    producer: Text | None = Field(default=None, min_length=1, max_length=300)
    """Who numbered the batch: one agent process (node and a start-up nonce). Older agents send none."""
    seq: int | None = Field(default=None, ge=1)
    """The batch's number from its producer, increasing: a number at or below the last one taken is a replay."""

    @model_validator(mode="after")
    def _numbered_together(self) -> SignalBatch:
        if (self.producer is None) != (self.seq is None):
            raise ValueError("producer and seq come together")
        return self


def to_record(s: SignalIn) -> Signal:
    """Wire model to internal record."""
    p = s.payload
    payload: LogLine | MetricSample | ProgressSample
    if isinstance(p, LogPayload):
        payload = LogLine(p.text, p.namespace, p.pod, p.container, p.job, p.rank)
    elif isinstance(p, MetricPayload):
        payload = MetricSample(p.name, p.value, dict(p.labels))
    else:
        payload = ProgressSample(p.job, p.rank, p.step, p.step_time, dict(p.phases), p.event, p.world_size,
                                 namespace=p.namespace, samples=p.samples, step_time_min=p.step_time_min,
                                 step_time_max=p.step_time_max, arrivals=tuple(p.arrivals),
                                 phases_sd=dict(p.phases_sd), phases_peak=dict(p.phases_peak))
    return Signal(id=s.id, node=s.node, source=s.source, ts=s.ts, payload=payload)


def to_wire(sig: Signal) -> dict[str, Any]:
    """Internal record to a JSON-ready dict (what the agent ships)."""
    p = sig.payload
    body: dict[str, Any]
    if isinstance(p, LogLine):
        body = {"kind": "log", "text": p.text}
        for k in ("namespace", "pod", "container", "job", "rank"):
            v = getattr(p, k)
            if v is not None:
                body[k] = v
    elif isinstance(p, MetricSample):
        body = {"kind": "metric", "name": p.name, "value": p.value, "labels": dict(p.labels)}
    else:
        body = {"kind": "progress", "job": p.job, "rank": p.rank, "step": p.step}
        if p.step_time is not None:
            body["step_time"] = p.step_time
        if p.phases:
            body["phases"] = dict(p.phases)
        if p.event != "step":
            body["event"] = p.event
        if p.world_size is not None:
            body["world_size"] = p.world_size
        if p.namespace is not None:
            body["namespace"] = p.namespace
        if p.samples != 1:
            body |= {"samples": p.samples, "step_time_min": p.step_time_min, "step_time_max": p.step_time_max}
        if p.arrivals:
            body["arrivals"] = [list(a) for a in p.arrivals]
        if p.phases_sd:
            body["phases_sd"] = dict(p.phases_sd)
        if p.phases_peak:
            body["phases_peak"] = dict(p.phases_peak)
    return {"id": sig.id, "node": sig.node, "source": sig.source.value, "ts": sig.ts, "payload": body}
