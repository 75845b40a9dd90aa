"""Ingest throughput: signals/s through store + analyzer + correlator, and over HTTP. Prints JSON."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import httpx

from collector.wire import to_wire
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from sim.faults import KernelLog
from sim.job import TrainingJob


def main(steps: int = 40, batch_steps: int = 4) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("core", "http"):
            settings = Settings(database_url=f"sqlite:///{Path(tmp) / (mode + '.db')}", cluster="sim")
            cluster = build_cluster(64)
            kmend = make_kmend(settings, cluster=cluster, notifier=LogNotifier())
            job = TrainingJob("bench", [n.name for n in cluster.list_nodes()], ranks_per_node=8)
            batches = []
            for b in range(0, steps, batch_steps):
                sigs = []
                for it in range(b, b + batch_steps):
                    sigs.extend(job.step(it + 1, 1.7e9 + it))
                batches.append(sigs)
            n = sum(len(b) for b in batches)
            if mode == "core":
                kmend.start()
                t = time.perf_counter()
                for batch in batches:
                    kmend.ingest(batch)
                dt = time.perf_counter() - t
            else:
                bodies = [json.dumps({"signals": [to_wire(s) for s in b]}) for b in batches]
                with serve_in_thread(create_app(kmend, settings, run_healer=False)) as url, \
                        httpx.Client(base_url=url, timeout=60) as c:
                    t = time.perf_counter()
                    for body in bodies:
                        c.post("/v1/signals", content=body, headers={"content-type": "application/json"})
                    dt = time.perf_counter() - t
            print(json.dumps({"bench": f"ingest_{mode}", "signals": n, "batch_size": len(batches[0]),
                              "seconds": round(dt, 3), "signals_per_s": round(n / dt)}))
            kmend.store.close()


def fault_flood(nodes: int = 512, batch: int = 256) -> None:
    """Xid 79 on one node, then an NCCL timeout from each of 4,096 ranks: one growing incident."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(database_url=f"sqlite:///{Path(tmp) / 'flood.db'}", cluster="sim")
        cluster = build_cluster(nodes)
        kmend = make_kmend(settings, cluster=cluster, notifier=LogNotifier())
        kmend.start()
        job = TrainingJob("flood", [n.name for n in cluster.list_nodes()], ranks_per_node=8)
        kmend.ingest(job.step(1, 1.7e9))
        kmend.ingest(KernelLog(job.nodes[3], 1.6e9).xid(1.7e9 + 5, 2, 79))
        sigs = job.nccl_timeouts(1.7e9 + 600, 99)
        t = time.perf_counter()
        for i in range(0, len(sigs), batch):
            kmend.ingest(sigs[i:i + batch])
        dt = time.perf_counter() - t
        [inc] = kmend.incidents()
        print(json.dumps({"bench": "ingest_fault_flood", "ranks": job.world_size, "batch_size": batch,
                          "seconds": round(dt, 3), "signals_per_s": round(len(sigs) / dt),
                          "incidents": 1, "root_cause_node": inc.root_cause.node,
                          "findings_in_incident": len(inc.findings)}))
        kmend.store.close()


if __name__ == "__main__":
    main()
    fault_flood()
