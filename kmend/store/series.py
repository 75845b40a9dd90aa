"""Stored metric series: the last sample of each series a metric rule watches, with its rules' streaks.

One row per series (id: the sha256 of its key). The single process writes them with each batch and reads
them back at start; replicas also read a batch's series in its transaction, rows locked, so a node's
batches give the same findings whichever replica takes each of them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, select

from analyzer.metric_eval import SeriesState
from kmend.store import schema


def series_id(key: Sequence[str]) -> str:
    """A series' row id: the sha256 of its key."""
    return hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()


def series_row(st: SeriesState) -> dict[str, Any]:
    """A series state as its row."""
    return {"id": series_id(st.key), "ts": st.ts,
            "body": {"key": list(st.key), "value": st.value, "ts": st.ts, "streak": dict(st.streak)}}


def series_state(body: Mapping[str, Any]) -> SeriesState:
    """A row's body as the evaluator's state."""
    return SeriesState(tuple(body["key"]), float(body["value"]), float(body["ts"]),
                       {str(k): int(v) for k, v in body["streak"].items()})


def locked_series(conn: Connection, keys: Sequence[Sequence[str]]) -> dict[tuple[str, ...], SeriesState]:
    """The stored states of these series, their rows locked until the transaction ends (PostgreSQL).

    Rows are locked in id order, so two batches sharing series cannot deadlock on them.
    """
    ms = schema.metric_series
    q = (select(ms.c.body).where(ms.c.id.in_(sorted({series_id(k) for k in keys}))).order_by(ms.c.id)
         .with_for_update())
    return {(st := series_state(b)).key: st for (b,) in conn.execute(q)}
