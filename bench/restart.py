"""Restart-to-ready with a large store. Prints one JSON object.

The store (SQLite, a file) holds `--findings` findings: a month of history of a 1,000-node fleet —
resolved incidents of 10 Xid findings each, spread over 30 days — plus what is live at the restart:
`--open` open incidents (10 findings each) and one flood incident of `--flood` findings (every rank
of a job timing out). Rows are written straight into the tables, in the shape the service writes.

Measured: seconds from constructing the service (`make_kmend`, rules loaded) through `start()`
(migration check, state rebuilt) to ready, and what was rebuilt. With `--compare`, the old
finding-by-finding replay of every stored finding is timed on the same store (`--compare-limit`
findings of it, as the full replay takes minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from analyzer.correlate import Correlator
from analyzer.records import Finding, IncidentState
from healer.notify import LogNotifier
from kmend.serialize import finding_to_dict, incident_to_dict
from kmend.settings import Settings
from kmend.store import schema
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

# The test builders give real log lines; the bench runs from a checkout (python bench/...).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.builders import XID79, container, kernel, nccl_timeout

MONTH_S = 30 * 86400.0
T_END = 1_700_000_000.0


def _templates(db: Path) -> tuple[Finding, Finding]:
    """One real Xid 79 finding and one real NCCL-timeout finding, from the shipped rules."""
    k = make_kmend(Settings(database_url=f"sqlite:///{db}", cluster="sim"), cluster=build_cluster(2),
                   notifier=LogNotifier())
    k.start()
    xid = k.ingest([kernel("gpu-node-0001", XID79, ts=T_END - MONTH_S)]).findings[0]
    nccl = k.ingest([container("gpu-node-0002", nccl_timeout(9), job="flood", rank=9, ts=T_END - 60)]).findings[0]
    k.store.close()
    return xid, nccl


def fill(db: Path, findings: int, open_incidents: int, flood: int) -> None:
    xid, nccl = _templates(db.with_suffix(".tmpl.db"))
    k = make_kmend(Settings(database_url=f"sqlite:///{db}", cluster="sim"), cluster=build_cluster(2),
                   notifier=LogNotifier())
    k.store.migrate()
    engine = k.store.engine
    history = findings - open_incidents * 10 - flood
    seq = 0

    def write(incs: list[dict[str, object]], rows: list[dict[str, object]]) -> None:
        with engine.begin() as conn:
            conn.execute(schema.incidents.insert(), incs)
            conn.execute(schema.findings.insert(), rows)

    def group(n: int, base: Finding, ts0: float, step: float, node: str, state: IncidentState,
              rank: bool = False) -> tuple[dict[str, object], list[dict[str, object]]]:
        nonlocal seq
        fs = [replace(base, id=f"{base.id}#{seq + i}", ts=ts0 + i * step,
                      where=replace(base.where, node=node, rank=i if rank else base.where.rank)) for i in range(n)]
        corr = Correlator()
        inc = corr.add_all(fs)[0]
        inc = replace(inc, state=state)
        rows = []
        for f in fs:
            seq += 1
            rows.append({"id": f.id, "seq": seq, "incident_id": inc.id, "ts": f.ts, "fault_class": f.fault_class.value,
                         "node": f.where.node, "body": finding_to_dict(f)})
        row = {"id": inc.id, "state": inc.state.value, "fault_class": inc.fault_class.value, "hardware": inc.hardware,
               "node": inc.root_cause.node, "opened_at": inc.opened_at, "updated_at": inc.updated_at,
               "body": incident_to_dict(inc, findings=False)}
        return row, rows

    incs: list[dict[str, object]] = []
    rows: list[dict[str, object]] = []
    n_hist = history // 10
    for i in range(n_hist):
        inc, fs = group(10, xid, T_END - MONTH_S + i * (MONTH_S - 7200) / max(n_hist, 1), 1.0,
                        f"gpu-node-{i % 1000:04d}", IncidentState.RESOLVED)
        incs.append(inc)
        rows += fs
        if len(rows) >= 50_000:
            write(incs, rows)
            incs, rows = [], []
    for i in range(open_incidents):
        inc, fs = group(10, xid, T_END - 600 + i * 0.1, 1.0, f"gpu-node-{i % 1000:04d}", IncidentState.OPEN)
        incs.append(inc)
        rows += fs
    if flood:  # on a node with no Xid: a job-wide failure of its own
        inc, fs = group(flood, nccl, T_END - 60, 0.001, "gpu-node-9999", IncidentState.OPEN, rank=True)
        incs.append(inc)
        rows += fs
    write(incs, rows)
    k.store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--findings", type=int, default=1_000_000)
    ap.add_argument("--open", type=int, default=500)
    ap.add_argument("--flood", type=int, default=20_000)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--compare-limit", type=int, default=20_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "k.db"
        t = time.perf_counter()
        fill(db, args.findings, args.open, args.flood)
        fill_s = time.perf_counter() - t
        t = time.perf_counter()
        k = make_kmend(Settings(database_url=f"sqlite:///{db}", cluster="sim"), cluster=build_cluster(2),
                       notifier=LogNotifier())
        k.start()
        ready_s = time.perf_counter() - t
        live = k.incidents()
        out: dict[str, object] = {
            "bench": "restart", "stored_findings": args.findings, "fill_s": round(fill_s, 1),
            "restart_to_ready_s": round(ready_s, 2), "incidents_in_memory": len(live),
            "findings_in_memory": sum(len(i.findings) for i in live),
            "largest_incident_findings": max((len(i.findings) for i in live), default=0),
        }
        if args.compare:
            every = k.store.findings_in_order()[:args.compare_limit]
            t = time.perf_counter()
            corr = Correlator()
            for f in every:
                corr.add(f)
            out["old_replay_s"] = round(time.perf_counter() - t, 2)
            out["old_replay_findings"] = len(every)
        k.store.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
