"""A simulated GPU fleet through several replicas on one PostgreSQL: no signal lost, one incident per fault, and
the Lease holder's CPU and memory per 1,000 nodes. Prints one JSON object.

Fleet: `--nodes` nodes of 8 GPUs, one 8-rank pod per node, jobs of 64 nodes (512 ranks). Per node and per
`--window-s` (5 s: the agent's default ``progress_summary_s``) the node's agent ships one numbered batch to its
replica (agents stay on one replica, as keep-alive does):
- 8 progress summaries, made by the agent's own reducer (``collector.progress_summary``) from 5 step samples
  of 1 s each per rank;
- metric changes at `--metric-changes` per node per second (the agent ships changes, not samples: a
  temperature or clock that moved);
- container and kernel lines that pass the agent's prefilter at `--lines` per node per second.
`--faults` Xid 79s, each on one node of a different job, with the NCCL timeouts of that job's ranks on it and
on three more of its nodes.

Time is scaled down: windows are pushed as fast as the replicas take them (one process, cores ingest in turn),
and each window stands for `--window-s` seconds of fleet time. The leader runs in its own process (a core that
holds the Lease, folding the feed and running the detectors as `kmend serve` does), so its CPU time and RSS are
its own. Leader CPU per fleet-second is reported per 1,000 nodes; at `--nodes` below 12,500 the 12,500-node
figure is extrapolated linearly and says so. Live (default), the leader folds rows as they come, a few at a
time, because this machine's replicas deliver far fewer rows a second than 12,500 nodes would; with
`--catch-up` it folds the whole feed at once in full pages, which is its cost when saturated.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import create_engine, text

from collector.progress_summary import ProgressWindows
from collector.signal import LogLine, MetricSample, ProgressSample, Signal, Source
from healer.notify import LogNotifier
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

# The test builders give real log lines; the bench runs from a checkout (python bench/...).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.builders import nccl_timeout

GPUS, JOB_NODES = 8, 64
NVSENTINEL_MB_PER_NODE = 2.2
"""NVSentinel's published 100k-node figure (measured on their system, another way): context only."""


class Seat:
    """A fixed Lease holder (the elector itself is covered by the tests)."""

    def __init__(self, leader: bool) -> None:
        self.leader = leader

    def is_leader(self) -> bool:
        return self.leader

    def tick(self) -> bool:
        return self.leader


def database(admin: str) -> str:
    name = f"kmend_fleet_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin.rsplit("/", 1)[0] + f"/{name}"


def core(url: str, *, leader: bool) -> Kmend:
    settings = Settings(database_url=url, cluster="sim", replicated=True, symptom_settle_s=0,
                        identity="leader" if leader else f"replica-{uuid.uuid4().hex[:4]}")
    k = make_kmend(settings, cluster=build_cluster(4), notifier=LogNotifier(), leader=Seat(leader))
    k.start()
    return k


def _memory() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    got = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line.split(":")[0]] = int(line.split()[1]) / 1024
    return got["VmRSS"], got["VmHWM"]


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def leader_main(url: str, ready: Any, go: Any, drain: Any, out: Any) -> None:
    """The Lease holder: fold the feed and run the detectors until told to drain, then report."""
    k = core(url, leader=True)
    assert k.replicas is not None
    rss0, _ = _memory()
    cpu0 = _cpu()
    ready.set()
    go.wait()
    folded, idle, evaluations, tail_cpu, detect_cpu = 0, 0, 0, 0.0, 0.0
    next_eval = time.monotonic()
    while True:
        c = _cpu()
        n = k.replicas.tail()
        tail_cpu += _cpu() - c
        folded += n
        if time.monotonic() >= next_eval:  # as `kmend serve` does, every KMEND_DETECTOR_INTERVAL_S (1 s)
            c = _cpu()
            # On the fleet's clock (the signals' own time): windows arrive slower than real time here, and the
            # wall clock would call every job whose next window is still queued a hang.
            k.evaluate(k.detectors.watermark or None)
            detect_cpu += _cpu() - c
            evaluations += 1
            next_eval = time.monotonic() + 1.0
        if n == 0:
            if drain.is_set():
                idle += 1
                if idle >= 3:
                    break
            time.sleep(0.05)
        else:
            idle = 0
    cpu = _cpu() - cpu0
    rss, hwm = _memory()
    active = k.analyzer.correlator.active()
    book = k.detectors.book
    out.put({"cpu_s": cpu, "tail_cpu_s": tail_cpu, "detect_cpu_s": detect_cpu, "evaluations": evaluations,
             "rss_mb": rss, "rss_start_mb": rss0, "hwm_mb": hwm, "rows_folded": folded,
             "ranks_in_book": sum(len(j.ranks) for j in book.jobs.values()),
             "incidents": sorted((i.root_cause.node or "", i.fault_class.value) for i in active)})
    k.replicas.close()


def fleet_window(w: int, nodes: int, t0: float, args: argparse.Namespace, rng: random.Random,
                 faults: dict[int, int]) -> dict[int, list[Signal]]:
    """One window's batch per node (node index -> signals)."""
    out: dict[int, list[Signal]] = {}
    end = t0 + (w + 1) * args.window_s
    steps = int(args.window_s)
    for n in range(nodes):
        name = f"gpu-{n:05d}"
        job = f"job-{n // JOB_NODES:04d}"
        windows = ProgressWindows()
        for g in range(GPUS):
            rank = (n % JOB_NODES) * GPUS + g
            for s in range(steps):
                step = w * steps + s + 1
                ts = end - args.window_s + s + 1
                windows.add(Signal(f"{name}/progress/{job}.rank{rank}.jsonl/{step}", name, Source.PROGRESS, ts,
                                   ProgressSample(job, rank, step, 1.0 + rng.uniform(-0.02, 0.02),
                                                  world_size=JOB_NODES * GPUS)))
        batch = windows.flush()
        for i in range(_count(rng, args.metric_changes * args.window_s)):
            batch.append(Signal(f"{name}/dcgm/{w}/{i}", name, Source.DCGM, end - rng.random() * args.window_s,
                                MetricSample("DCGM_FI_DEV_GPU_TEMP", float(60 + rng.randrange(20)),
                                             {"gpu": str(rng.randrange(GPUS))})))
        for i in range(_count(rng, args.lines * args.window_s)):
            rank = (n % JOB_NODES) * GPUS + rng.randrange(GPUS)
            line = f"[rank{rank}]: NCCL INFO Channel 0{i % 8}/32 : {rank} -> {rank + 1} via P2P/IPC"
            batch.append(Signal(f"{name}/container/{w}/{i}", name, Source.CONTAINER, end - rng.random() * args.window_s,
                                LogLine(line, "train", f"{job}-worker-{n % JOB_NODES}", "trainer", job, rank)))
        if faults.get(n) == w:
            batch.append(Signal(f"{name}/kernel/{w}/xid", name, Source.KERNEL, end - 2,
                                LogLine("NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.")))
        out[n] = batch
    for n, fw in faults.items():
        if fw != w:
            continue
        first = n - n % JOB_NODES
        for m in sorted({n, first, first + 1, first + 2}):
            rank = (m % JOB_NODES) * GPUS
            job = f"job-{m // JOB_NODES:04d}"
            out[m].append(Signal(f"gpu-{m:05d}/container/{w}/timeout", f"gpu-{m:05d}", Source.CONTAINER, end - 1,
                                 LogLine(nccl_timeout(rank), "train", f"{job}-worker-{m % JOB_NODES}", "trainer",
                                         job, rank)))
    return out


def _count(rng: random.Random, mean: float) -> int:
    whole = int(mean)
    return whole + (1 if rng.random() < mean - whole else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--database-url", required=True, help="PostgreSQL server (a database is created for the run)")
    ap.add_argument("--nodes", type=int, default=12_500)
    ap.add_argument("--replicas", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=5.0)
    ap.add_argument("--lines", type=float, default=0.2, help="prefiltered log lines per node per second")
    ap.add_argument("--metric-changes", type=float, default=0.2, help="metric changes per node per second")
    ap.add_argument("--faults", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--catch-up", action="store_true", help="the leader starts folding only once every window is in "
                    "the feed: its cost when saturated (large pages), the bound on the fleet one leader holds")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    url = database(args.database_url)
    jobs = max(1, args.nodes // JOB_NODES)
    fault_jobs = rng.sample(range(jobs), min(args.faults, jobs))
    faults = {j * JOB_NODES + 5 + rng.randrange(JOB_NODES - 5): 1 + rng.randrange(max(1, args.windows - 1))
              for j in fault_jobs}

    replicas = [core(url, leader=False) for _ in range(args.replicas)]  # the first one migrates the schema
    ctx = mp.get_context("spawn")
    ready, go, drain, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    leader = ctx.Process(target=leader_main, args=(url, ready, go, drain, out))
    leader.start()
    ready.wait(120)
    if not args.catch_up:
        go.set()

    t0 = time.time() - args.windows * args.window_s - 120
    sent = accepted = lines = 0
    seqs = [0] * args.nodes
    wall0 = time.perf_counter()
    for w in range(args.windows):
        for n, batch in fleet_window(w, args.nodes, t0, args, rng, faults).items():
            seqs[n] += 1
            got = replicas[n % args.replicas].ingest(batch, (f"gpu-{n:05d}/agent", seqs[n]))
            sent += len(batch)
            accepted += got.accepted
            lines += sum(1 for s in batch if isinstance(s.payload, LogLine))
    ingest_wall = time.perf_counter() - wall0
    go.set()
    drain.set()
    report = out.get(timeout=600)
    leader.join(60)
    drain_wall = time.perf_counter() - wall0 - ingest_wall

    engine = create_engine(url)
    with engine.connect() as conn:
        stored = int(conn.execute(text("SELECT count(*) FROM signals")).scalar_one())
    engine.dispose()
    fleet_s = args.windows * args.window_s
    per_k = args.nodes / 1000
    # Folding grows with the traffic (fleet time); a detector run with the fleet's size, once per fleet-second in
    # `kmend serve` (KMEND_DETECTOR_INTERVAL_S=1), however fast this run pushed the windows.
    fold_per_k = report["tail_cpu_s"] / fleet_s / per_k
    detect_per_k = report["detect_cpu_s"] / max(1, report["evaluations"]) / per_k
    cpu_per_fleet_s_per_k = fold_per_k + detect_per_k
    want = sorted((f"gpu-{n:05d}", "gpu_lost") for n in faults)
    print(json.dumps({
        "nodes": args.nodes, "gpus": args.nodes * GPUS, "replicas": args.replicas, "windows": args.windows,
        "leader_mode": "catch-up" if args.catch_up else "live",
        "fleet_seconds": fleet_s, "signals_sent": sent, "signals_accepted": accepted,
        "signals_per_fleet_second": round(sent / fleet_s),
        "no_signal_lost": accepted == sent and stored == lines and report["ranks_in_book"] == args.nodes * GPUS,
        "log_lines_sent": lines, "log_lines_stored": stored, "ranks_at_leader": report["ranks_in_book"],
        "faults": len(faults), "incidents": report["incidents"], "one_incident_per_fault": report["incidents"] == want,
        "replica_ingest_wall_s": round(ingest_wall, 1), "replica_signals_per_s": round(sent / ingest_wall),
        "leader_drain_after_ingest_s": round(drain_wall, 1), "leader_rows_folded": report["rows_folded"],
        "leader_cpu_s": round(report["cpu_s"], 1), "leader_fold_cpu_s": round(report["tail_cpu_s"], 1),
        "leader_detector_cpu_s": round(report["detect_cpu_s"], 1), "leader_detector_runs": report["evaluations"],
        "leader_fold_cpu_s_per_fleet_s_per_1000_nodes": round(fold_per_k, 4),
        "leader_detector_cpu_s_per_run_per_1000_nodes": round(detect_per_k, 4),
        "leader_cpu_s_per_fleet_s_per_1000_nodes": round(cpu_per_fleet_s_per_k, 4),
        "leader_cores_for_12500_nodes_extrapolated_linearly": round(cpu_per_fleet_s_per_k * 12.5, 2),
        "leader_rss_mb": round(report["rss_mb"]), "leader_rss_at_start_mb": round(report["rss_start_mb"]),
        "leader_peak_rss_mb": round(report["hwm_mb"]),
        "leader_peak_rss_mb_per_1000_nodes": round(report["hwm_mb"] / per_k, 1),
        "leader_growth_mb_per_1000_nodes": round((report["hwm_mb"] - report["rss_start_mb"]) / per_k, 1),
        "nvsentinel_published_mb_per_node_context_only": NVSENTINEL_MB_PER_NODE,
    }))
    for k in replicas:
        assert k.replicas is not None
        k.replicas.close()


if __name__ == "__main__":
    main()
