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


if __name__ == "__main__":
    main()
