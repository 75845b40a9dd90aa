"""Replicas on one PostgreSQL: the feed's write path, findings folded per second by the Lease holder, and the
database part of a takeover. Prints one JSON object.

Two `Kmend` cores built as `kmend serve --replicated` builds them (shipped rules, real PostgreSQL at
``--database-url``), one holding the Lease. Replica b ingests `--batches` batches of `--lines` kernel lines,
`--faults` of them GPU faults (Xid 79 / 48 / 63 / 94 on random GPUs of a 1,000-node fleet), numbered per
producer; then the leader a folds the whole feed (``tail``); then b takes the Lease over (restore the open
incidents, read the cursor). In the same run, a third core in single-replica mode on its own database ingests
the same batches (match, correlate and store in one step): the ratio compares the two write paths.
The Lease's own part of a takeover (its duration, 15 s by default) is not included.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from pathlib import Path

import psycopg

from collector.signal import Signal
from healer.notify import LogNotifier
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

# The test builders give real log lines; the bench runs from a checkout (python bench/...).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.builders import kernel

XIDS = ("79, pid=0, GPU has fallen off the bus.", "48, pid=1234, An uncorrectable double bit error (DBE) occurred",
        "63, pid=0, ECC page retirement or row remapping recording event", "94, pid=0, Contained ECC error")


class Seat:
    """A fixed Lease holder (the elector itself is covered by the tests)."""

    def __init__(self, holder: list[str], name: str) -> None:
        self.holder, self.name = holder, name

    def is_leader(self) -> bool:
        return self.holder[0] == self.name

    def tick(self) -> bool:
        return self.is_leader()


def batches(n: int, lines: int, faults: int, seed: int) -> list[list[Signal]]:
    rng = random.Random(seed)
    out = []
    t = 1_700_000_000.0
    for b in range(n):
        batch = []
        for i in range(lines):
            node = f"gpu-node-{rng.randrange(1000):04d}"
            ts = t + b + i / lines
            if i < faults:
                bus = f"{rng.randrange(8) * 16 + 0x1b:02x}"
                text = f"[ 812{b}.{i:06d}] NVRM: Xid (PCI:0000:{bus}:00): {rng.choice(XIDS)}"
            else:
                text = f"[ 812{b}.{i:06d}] eth0: link up, 100Gbps, full-duplex, lpa 0x{rng.randrange(1 << 16):04X}"
            batch.append(kernel(node, text, ts=ts))
        out.append(batch)
    return out


def database(admin: str) -> str:
    name = f"kmend_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin.rsplit("/", 1)[0] + f"/{name}"


def core(url: str, *, replicated: bool, seat: Seat | None = None) -> Kmend:
    settings = Settings(database_url=url, cluster="sim", replicated=replicated, symptom_settle_s=3600)
    k = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier(), leader=seat)
    k.start()
    return k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--database-url", required=True, help="PostgreSQL server (a database is created per core)")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--lines", type=int, default=500)
    ap.add_argument("--faults", type=int, default=25)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    work = batches(args.batches, args.lines, args.faults, args.seed)
    signals = args.batches * args.lines

    holder = ["a"]
    shared = database(args.database_url)
    a, b = core(shared, replicated=True, seat=Seat(holder, "a")), core(shared, replicated=True, seat=Seat(holder, "b"))
    single = core(database(args.database_url), replicated=False)
    assert a.replicas is not None and b.replicas is not None

    t0 = time.perf_counter()
    found = sum(len(b.ingest(batch, ("bench/p1", i + 1)).findings) for i, batch in enumerate(work))
    feed_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, batch in enumerate(work):
        single.ingest(batch, ("bench/p1", i + 1))
    single_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    rows = a.replicas.tail()
    tail_s = time.perf_counter() - t0
    incidents = len(a.analyzer.correlator.active())
    same = sorted(i.id for i in a.analyzer.correlator.active()) == sorted(i.id for i in
                                                                         single.analyzer.correlator.active())

    holder[0] = "b"
    a.replicas.tail()
    t0 = time.perf_counter()
    b.replicas.tail()
    takeover_s = time.perf_counter() - t0
    print(json.dumps({
        "signals": signals, "batches": args.batches, "findings": found, "feed_rows": rows,
        "open_incidents": incidents, "same_incidents_as_single_replica": same,
        "replica_ingest_signals_per_s": round(signals / feed_s),
        "single_replica_ingest_signals_per_s": round(signals / single_s),
        "replica_to_single_ratio": round(single_s / feed_s, 3),
        "leader_tail_findings_per_s": round(found / tail_s),
        "leader_tail_s": round(tail_s, 3),
        "takeover_restore_s": round(takeover_s, 3),
        "takeover_open_incidents": len(b.analyzer.correlator.active()),
    }))
    for k in (a, b):
        assert k.replicas is not None
        k.replicas.close()


if __name__ == "__main__":
    main()
