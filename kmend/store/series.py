"""Stored metric series: the last sample of each series a metric rule watches, with its rules' streaks.

One row per series (id: the sha256 of its key). The single process writes them with each batch and reads
them back at start; replicas also read a batch's series in its transaction, after its producer mark, so a node's
batches give the same findings whichever replica takes each of them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

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


def stored_series(conn: Connection, keys: Sequence[Sequence[str]]) -> dict[tuple[str, ...], SeriesState]:
    """The stored states of these series (PostgreSQL), read in the batch's transaction.

    The batch's producer mark, taken first in the same transaction, already holds the agent's next batch back
    until this one commits, so the states read are the last committed. One driver-level statement with the ids
    as one array parameter: built with SQLAlchemy's expanded ``IN`` it cost 10 ms for a batch's 40 series here,
    this way under 1 ms.
    """
    ids = sorted({series_id(k) for k in keys})
    rows = conn.exec_driver_sql(f"SELECT body FROM {schema.metric_series.name} WHERE id = ANY(%s)", (ids,))
    return {(st := series_state(b if isinstance(b, dict) else json.loads(b))).key: st for (b,) in rows}
