"""Decoding ``POST /v1/signals`` bodies at C speed (msgspec), with the pydantic wire model for the errors.

The common body is well formed: msgspec decodes and checks it in one pass in C, several times
faster than validating it with pydantic. It checks the same limits as `collector.wire` (lengths,
ranges, finite numbers, closed sets, no unknown field), and the two checks it leaves out are done
here once per body: no JSON-escaped NUL anywhere (then no string holds one), and each distinct node
name is a DNS-1123 subdomain. Anything msgspec refuses goes through the pydantic model, which either
accepts it (pydantic is laxer: a number in a string) or answers the 422 naming the field, exactly
as before. So msgspec never accepts what pydantic would refuse; it only answers faster.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from collector.signal import MAX_ARRIVALS, DecodedBatch, LogLine, MetricSample, ProgressSample, Signal, Source
from collector.validate import MAX_NODE_NAME, node_name_problem

_MAX = 1.7976931348623157e308
Finite = Annotated[float, Meta(ge=-_MAX, le=_MAX)]
"""A finite float: 1e309 decodes to infinity and is refused here, as pydantic's allow_inf_nan=False does."""
Name = Annotated[str, Meta(max_length=253)]
"""A namespace, pod, container or job name."""


class _Log(Struct, tag_field="kind", tag="log", forbid_unknown_fields=True):
    text: Annotated[str, Meta(max_length=65536)]
    namespace: Name | None = None
    pod: Name | None = None
    container: Name | None = None
    job: Name | None = None
    rank: Annotated[int, Meta(ge=0)] | None = None


class _Metric(Struct, tag_field="kind", tag="metric", forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    value: Finite
    labels: Annotated[dict[str, str], Meta(max_length=64)] = {}


class _Progress(Struct, tag_field="kind", tag="progress", forbid_unknown_fields=True):
    job: Annotated[str, Meta(min_length=1, max_length=253)]
    rank: Annotated[int, Meta(ge=0)]
    step: Annotated[int, Meta(ge=0)]
    step_time: Annotated[float, Meta(ge=0, le=_MAX)] | None = None
    phases: Annotated[dict[str, Finite], Meta(max_length=64)] = {}
    event: Literal["step", "end", "exit", "start"] = "step"
    world_size: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    namespace: Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^[^\x00/]+$")] | None = None
    samples: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    step_time_min: Annotated[float, Meta(ge=0, le=_MAX)] | None = None
    step_time_max: Annotated[float, Meta(ge=0, le=_MAX)] | None = None
    arrivals: Annotated[list[tuple[Annotated[int, Meta(ge=0)], Finite, Annotated[float, Meta(ge=0, le=_MAX)] | None]],
                        Meta(max_length=MAX_ARRIVALS)] = []
    phases_sd: Annotated[dict[str, Annotated[float, Meta(ge=0, le=_MAX)]], Meta(max_length=64)] = {}
    phases_peak: Annotated[dict[str, Finite], Meta(max_length=64)] = {}


class _Signal(Struct, forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1, max_length=512)]
    node: Annotated[str, Meta(min_length=1, max_length=MAX_NODE_NAME)]
    source: Source
    ts: Annotated[float, Meta(gt=0, le=_MAX)]
    payload: _Log | _Metric | _Progress


class _Batch(Struct, forbid_unknown_fields=True):
    signals: Annotated[list[_Signal], Meta(max_length=50000)]
    producer: Annotated[str, Meta(min_length=1, max_length=300)] | None = None
    seq: Annotated[int, Meta(ge=1)] | None = None


Origin = tuple[str, int]
"""(producer, seq) of a numbered batch."""


_DECODER = msgspec.json.Decoder(_Batch)


class _Head(Struct):
    signals: list[msgspec.Raw] = []
    producer: str | None = None
    seq: int | None = None


_HEAD = msgspec.json.Decoder(_Head)


def peek_origin(body: bytes) -> tuple[Origin, int] | None:
    """A numbered batch's (producer, seq) and how many signals it holds, without decoding the signals.

    The signals are only delimited (msgspec skips their contents at C speed, about 30 times faster than
    decoding them), so a replay can be answered before any of its signals is built. None when the body
    is not a numbered batch this can read: the full decode then accepts or refuses it.
    """
    try:
        head = _HEAD.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):  # deep nesting: the full decode refuses it
        return None
    if head.producer is None or head.seq is None or not head.producer or head.seq < 1:
        return None
    return (head.producer, head.seq), len(head.signals)


def decode_fast(body: bytes) -> tuple[DecodedBatch, Origin | None] | None:
    """The batch's signals and origin, or None when the body needs the pydantic model (to accept or refuse it).

    The texts of the log lines are kept with the batch as they are read (see DecodedBatch): the rule
    engine scans them without walking the signals again.
    """
    if b"\\u0000" in body:
        return None
    try:
        batch = _DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if (batch.producer is None) != (batch.seq is None):
        return None
    nodes = {s.node for s in batch.signals}
    if any("\n" in n or node_name_problem(n) is not None for n in nodes):
        return None
    out: list[Signal] = []
    append = out.append
    texts: list[str] = []
    keep = texts.append
    mixed = False
    for s in batch.signals:
        p = s.payload
        payload: LogLine | MetricSample | ProgressSample
        if type(p) is _Log:
            keep(text := p.text)
            payload = LogLine(text, p.namespace, p.pod, p.container, p.job, p.rank)
        elif type(p) is _Metric:
            mixed = True
            payload = MetricSample(p.name, p.value, p.labels)
        else:
            assert isinstance(p, _Progress)
            mixed = True
            payload = ProgressSample(p.job, p.rank, p.step, p.step_time, p.phases, p.event, p.world_size,
                                     namespace=p.namespace, samples=p.samples, step_time_min=p.step_time_min,
                                     step_time_max=p.step_time_max, arrivals=tuple(p.arrivals),
                                     phases_sd=p.phases_sd, phases_peak=p.phases_peak)
        append(Signal(s.id, s.node, s.source, s.ts, payload))
    logs = [sig for sig in out if type(sig.payload) is LogLine] if mixed else None
    return (DecodedBatch(out, texts, logs=logs),
            None if batch.producer is None or batch.seq is None else (batch.producer, batch.seq))
