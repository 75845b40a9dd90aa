"""The replica feed on PostgreSQL: every replica writes what its batches gave, the Lease holder reads it in order.

Writing (any replica): the batch's log lines, its producer's high-water mark, the metric series it moved
and one feed row (the batch's digest) commit in one transaction. The producer mark is taken with
``INSERT … ON CONFLICT DO UPDATE … WHERE seq < new RETURNING``: the row lock makes a second replica that
received the same numbered batch wait for the first and then see it as a replay.

Reading (the leader): ``seq`` is an identity column, so numbers are handed out when a row is inserted,
not when its transaction commits; reading ``seq > last`` would skip a lower number committed late. Each
row also carries its transaction id, and the reader takes only rows of transactions older than the
oldest one still running (``pg_snapshot_xmin``), ordered by (tx, seq): every such transaction has ended,
so no row can later appear below the cursor. The cursor is stored with the results it produced, guarded by
its previous value, so a deposed leader's late write fails instead of folding a row twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import BigInteger, ColumnClause, Connection, delete, func, literal_column, select, text, tuple_

from analyzer.detectors.flight_recorder import Dump, Entry
from analyzer.detectors.stacks import StackSample
from analyzer.digest import BatchDigest, DumpReport, StackReport
from analyzer.metric_eval import SeriesState, SignalEvaluator
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from collector.signal import MetricSample, Signal, Source
from kmend.serialize import finding_from_dict, finding_to_dict
from kmend.store import schema
from kmend.store.series import stored_series
from kmend.store.store import IngestOutcome, Store, _kept

CURSOR = "leader"
"""The feed cursor's row name."""
NOTIFY_CHANNEL = "kmend_feed"
"""PostgreSQL channel a replica notifies when its feed row commits (the leader listens and reads at once)."""
_TX: ColumnClause[int] = literal_column("pg_current_xact_id()::text::bigint", type_=BigInteger)
_HORIZON: ColumnClause[int] = literal_column("pg_snapshot_xmin(pg_current_snapshot())::text::bigint", type_=BigInteger)
"""Oldest transaction still running: every transaction below it has committed or rolled back."""


class CursorMoved(RuntimeError):
    """Another replica advanced the feed cursor: this one no longer leads; its results were rolled back."""


@dataclass(frozen=True, slots=True)
class FeedRow:
    """One batch's digest as the leader reads it."""

    tx: int
    """Writing transaction id."""
    seq: int
    """Identity number of the row."""
    digest: BatchDigest
    """What the batch gave."""


def digest_to_dict(d: BatchDigest) -> dict[str, Any]:
    """A digest as JSON."""
    return {
        "findings": [finding_to_dict(f) for f in d.findings],
        "placements": [list(p) for p in d.placements], "placed_at": d.placed_at, "newest": d.newest,
        "progress": [asdict(e) | {"kind": e.kind.value, "phases": dict(e.phases)} for e in d.progress],
        "metrics": [[s.node, s.source.value, s.ts, s.payload.name, s.payload.value, dict(s.payload.labels)]
                    for s in d.metrics if isinstance(s.payload, MetricSample)],
        "stacks": [[st.job, st.ts, st.sample.rank, st.sample.node, st.sample.pid, st.sample.text, st.sample.state,
                    st.sample.source, st.sample.cpu_s] for st in d.stacks],
        "dumps": [{"job": r.job, "rank": r.rank, "node": r.node, "ts": r.ts, "source": r.source,
                   "entries": [[e.pg[0], e.pg[1], e.seq, e.op, e.completed] for e in r.dump.entries],
                   "groups": {name: [desc, list(ranks)] for name, (desc, ranks) in r.dump.groups.items()}}
                  for r in d.dumps],
    }


def digest_from_dict(d: dict[str, Any]) -> BatchDigest:
    """Inverse of digest_to_dict."""
    return BatchDigest(
        findings=tuple(finding_from_dict(f) for f in d["findings"]),
        placements=tuple((str(j), str(n)) for j, n in d["placements"]),
        placed_at=float(d["placed_at"]),
        progress=tuple(ProgressEvent(**(e | {"kind": ProgressKind(e["kind"])})) for e in d["progress"]),
        metrics=tuple(Signal(id="", node=node, source=Source(src), ts=ts, payload=MetricSample(name, value, labels))
                      for node, src, ts, name, value, labels in d["metrics"]),
        newest=float(d["newest"]),
        # A stack a replica without CPU times wrote has eight items.
        stacks=tuple(StackReport(job, StackSample(rank=rank, node=node, pid=pid, text=text, state=state,
                                                  source=source, cpu_s=cpu[0] if cpu else None), ts)
                     for job, ts, rank, node, pid, text, state, source, *cpu in d.get("stacks", [])),
        dumps=tuple(DumpReport(r["job"], int(r["rank"]), r["node"], _dump(r), float(r["ts"]), r["source"])
                    for r in d.get("dumps", [])),
    )


def _dump(r: dict[str, Any]) -> Dump:
    entries = tuple(Entry((name, desc), int(seq), op, bool(done)) for name, desc, seq, op, done in r["entries"])
    return Dump(entries=entries,
                groups={name: (desc, tuple(int(x) for x in ranks)) for name, (desc, ranks) in r["groups"].items()})


class Feed:
    """The feed tables of one store (PostgreSQL only)."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        if store.engine.dialect.name != "postgresql":
            raise ValueError("the replica feed needs PostgreSQL (KMEND_DATABASE_URL=postgresql+psycopg://...)")
        self.store = store
        self.clock = clock

    # -- any replica ----------------------------------------------------------------

    def ingest(self, signals: Sequence[Signal], digest: Callable[[Sequence[Signal]], BatchDigest],
               series: Callable[[], Sequence[SeriesState]] | None = None,
               origin: tuple[str, int] | None = None, evaluator: SignalEvaluator | None = None
               ) -> tuple[IngestOutcome, BatchDigest | None]:
        """Store a batch's lines and producer mark and its digest as one feed row, in one transaction.

        With `evaluator`, the stored states of the metric series the batch moves are read and
        adopted before the batch is analysed: a node's batches may alternate between replicas, and a counter's
        increase or a run of samples over a threshold must be judged on the series' whole past, once.
        Returns the outcome (findings, no incidents: the leader correlates) and the digest (None: a replay).
        """
        store = self.store
        unique: dict[str, Signal] = {}
        for s in signals:
            unique.setdefault(s.id, s)
        with store.engine.begin() as conn:
            if origin is not None:
                if not self._take_number(conn, *origin):
                    return IngestOutcome(0, len(signals), (), ()), None
                fresh = list(unique.values())
                self._adopt_series(conn, evaluator, fresh)
                got = digest(fresh)
                evidence = {e for f in got.findings for e in f.evidence} if store.lines == "evidence" else None
                store._insert_new(conn, [s for s in fresh if _kept(s) and (evidence is None or s.id in evidence)])
            else:
                new_ids = store._insert_new(conn, [s for s in unique.values() if _kept(s)])
                fresh = [s for s in unique.values() if s.id in new_ids or not _kept(s)]
                self._adopt_series(conn, evaluator, fresh)
                got = digest(fresh)
            if not got.empty:
                conn.execute(schema.replica_feed.insert().values(tx=_TX, at=self.clock(), body=digest_to_dict(got)))
                conn.execute(text(f"NOTIFY {NOTIFY_CHANNEL}"))
            if fresh and series is not None:
                store._upsert_series(conn, series())
        return IngestOutcome(len(fresh), len(signals) - len(fresh), got.findings, (), tuple(fresh)), got

    @staticmethod
    def _adopt_series(conn: Connection, evaluator: SignalEvaluator | None, fresh: Sequence[Signal]) -> None:
        if evaluator is not None and (keys := evaluator.series_keys(fresh)):
            evaluator.adopt(keys, stored_series(conn, keys))

    def open_incidents_by_node(self) -> dict[str, list[str]]:
        """Ids of the open or remediating incidents rooted on each node, oldest first, as the leader stored them."""
        inc = schema.incidents
        q = (select(inc.c.node, inc.c.id).where(inc.c.state.in_(("open", "remediating")), inc.c.node.is_not(None))
             .order_by(inc.c.opened_at, inc.c.id))
        out: dict[str, list[str]] = {}
        with self.store.engine.connect() as conn:
            for node, iid in conn.execute(q):
                out.setdefault(node, []).append(iid)
        return out

    def open_incident_counts(self) -> dict[str, int]:
        """Open or remediating incidents by fault class, as the leader stored them (one GROUP BY)."""
        inc = schema.incidents
        q = (select(inc.c.fault_class, func.count()).where(inc.c.state.in_(("open", "remediating")))
             .group_by(inc.c.fault_class))
        with self.store.engine.connect() as conn:
            return {str(fc): int(n) for fc, n in conn.execute(q)}

    def append(self, digest: BatchDigest) -> None:
        """One feed row outside a signal batch (a stack or Flight Recorder dump)."""
        with self.store.engine.begin() as conn:
            conn.execute(schema.replica_feed.insert().values(tx=_TX, at=self.clock(), body=digest_to_dict(digest)))
            conn.execute(text(f"NOTIFY {NOTIFY_CHANNEL}"))

    def _take_number(self, conn: Connection, producer: str, seq: int) -> bool:
        """Raise the producer's mark to `seq`; False when it is already there (a replay), after any writer ends."""
        prod = schema.producers
        stmt = self.store._insert(prod).values(id=producer, seq=seq, updated_at=self.clock())
        stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={"seq": stmt.excluded.seq,
                                                                       "updated_at": stmt.excluded.updated_at},
                                          where=prod.c.seq < stmt.excluded.seq).returning(prod.c.id)
        return conn.execute(stmt).first() is not None

    # -- the leader -------------------------------------------------------------------

    def cursor(self) -> tuple[int, int]:
        """(tx, seq) of the last row folded (created at (0, 0))."""
        cur = schema.feed_cursor
        with self.store.engine.begin() as conn:
            stmt = self.store._insert(cur).values(name=CURSOR, tx=0, seq=0, holder="", updated_at=self.clock())
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
            row = conn.execute(select(cur.c.tx, cur.c.seq).where(cur.c.name == CURSOR)).one()
        return int(row[0]), int(row[1])

    def read(self, after: tuple[int, int], limit: int = 500) -> list[FeedRow]:
        """Rows after the cursor from transactions that have all ended, in (tx, seq) order."""
        feed = schema.replica_feed
        q = (select(feed.c.tx, feed.c.seq, feed.c.body)
             .where(tuple_(feed.c.tx, feed.c.seq) > tuple_(*after), feed.c.tx < _HORIZON)
             .order_by(feed.c.tx, feed.c.seq).limit(limit))
        with self.store.engine.connect() as conn:
            return [FeedRow(int(tx), int(seq), digest_from_dict(body)) for tx, seq, body in conn.execute(q)]

    def advance(self, before: tuple[int, int], after: tuple[int, int], holder: str) -> Callable[[Connection], None]:
        """The cursor write to commit with the results: fails (CursorMoved) if another replica moved it."""
        cur = schema.feed_cursor

        def write(conn: Connection) -> None:
            done = conn.execute(cur.update().where(cur.c.name == CURSOR, cur.c.tx == before[0], cur.c.seq == before[1])
                                .values(tx=after[0], seq=after[1], holder=holder, updated_at=self.clock()))
            if done.rowcount != 1:
                raise CursorMoved(f"the feed cursor is no longer at {before} (another replica leads)")

        return write

    def prune(self, upto: tuple[int, int], keep_s: float = 600.0) -> int:
        """Delete folded rows older than `keep_s` (kept a while for inspection); returns rows deleted."""
        feed = schema.replica_feed
        with self.store.engine.begin() as conn:
            res = conn.execute(delete(feed).where(tuple_(feed.c.tx, feed.c.seq) <= tuple_(*upto),
                                                  feed.c.at < self.clock() - keep_s))
        return int(res.rowcount or 0)
