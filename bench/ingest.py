"""HTTP ingest on the real path: `kmend serve` as a process, the agent's gzip wire format, 8 clients. Prints JSON.

The store (SQLite) first holds a month of a 1,000-node fleet's findings (`--history`, written as
`bench/restart.py` writes them). Each batch is what one node's agent ships (`encode_batch`, gzip):
container log lines of 8 ranks (Megatron step lines and other output), kernel lines, metric
changes (DCGM temperature, power, utilisation per GPU), progress samples, and 0.1 % fault lines
(Xid 13/31/48/63/94 and NCCL errors); in the middle, a flood: an Xid 79 on one node of a 64-node
job, then an NCCL timeout from each of its 512 ranks, shipped by their own nodes.
`--clients` threads post the batches as fast as the service answers; the figures are
signals/s over the whole run and the p50/p99 of each POST's latency; and the server's own CPU seconds over
the run (from /proc), so signals per CPU-second, which a loaded shared machine disturbs far less.

In the same run, the same bodies go to the HTTP floor: a bare uvicorn endpoint in its own
process that reads and gunzips each body and answers (no parsing, no analysis). Both servers
are pinned to one core (`taskset`) when they can be; the ratio is the meaningful figure on a
shared machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from collector.shipper import encode_batch
from collector.signal import LogLine, MetricSample, ProgressSample, Signal, Source

REPO = Path(__file__).resolve().parent.parent
NODES = 1000
JOB_NODES = 64
RANKS = 8
BENIGN_KERNEL = (
    "[{t:.6f}] IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    "[{t:.6f}] EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Quota mode: none.",
    "[{t:.6f}] audit: type=1400 audit({t:.3f}:412): apparmor=\"STATUS\" operation=\"profile_replace\"",
    "[{t:.6f}] nvidia-nvswitch0: open (major=510)",
    "[{t:.6f}] mlx5_core 0000:ca:00.0: mlx5_pcie_event:301:(pid 0): PCIe slot advertised sufficient power (75W).",
)
APP_LINES = (
    "[rank{r}]: Saving checkpoint to /ckpt/iter_{s:07d}",
    "[rank{r}]: [2026-11-24 13:00:00] (INFO) data loader: epoch 3, shard 117 of 2048",
    "[rank{r}]: /usr/lib/python3/dist-packages/torch/utils/data/dataloader.py:558: UserWarning: This "
    "DataLoader will create 16 worker processes in total.",
)
FAULTS = (
    "NVRM: Xid (PCI:0000:{b}:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 0): Out Of Range Address",
    "NVRM: Xid (PCI:0000:{b}:00): 31, pid=1234, name=python, Ch 00000008, intr 00000000. MMU Fault: "
    "ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f4c_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    "NVRM: Xid (PCI:0000:{b}:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) "
    "has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
    "NVRM: Xid (PCI:0000:{b}:00): 63, pid='<unknown>', name=<unknown>, Row Remapper: New row (0x0000000000a1b2c3) "
    "was marked for remapping, reset gpu to activate.",
    "NVRM: Xid (PCI:0000:{b}:00): 94, pid=4021, name=python, Contained: SM (0x1). RST: No, D-RST: No",
)
NCCL_ERROR = ("[rank{r}]:[E ProcessGroupNCCL.cpp:1575] [PG 0 Rank {r}] Process group watchdog thread terminated "
              "with exception: NCCL error: remote process exited or there was a network error, NCCL version "
              "2.21.5")
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."
PCI = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")


class Fleet:
    """Signals as each node's agent would ship them, with ids unique per node and source."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.seq = 0
        self.step: dict[int, int] = {}
        self.temp: dict[tuple[int, int], float] = {}

    def _sig(self, node: int, source: Source, ts: float, payload: LogLine | MetricSample | ProgressSample) -> Signal:
        self.seq += 1
        return Signal(f"gpu-node-{node:04d}/{source.value}/{self.seq}", f"gpu-node-{node:04d}", source, ts, payload)

    def _line(self, node: int, ts: float, text: str, rank: int | None) -> Signal:
        job = f"job-{node // JOB_NODES:02d}"
        pod = f"{job}-worker-{node % JOB_NODES}"
        return self._sig(node, Source.CONTAINER, ts, LogLine(text, "training", pod, "trainer", job, rank))

    def batch(self, node: int, ts: float, size: int, fault_p: float) -> list[Signal]:
        """About `size` signals from one node: ~55 % container, 5 % kernel, 25 % metric changes, 15 % progress."""
        out: list[Signal] = []
        job = f"job-{node // JOB_NODES:02d}"
        first_rank = node % JOB_NODES * RANKS
        while len(out) < size:
            step = self.step[node] = self.step.get(node, 0) + 1
            for local in range(RANKS):
                r = first_rank + local
                ms = 850 * (1 + self.rng.uniform(-0.02, 0.02))
                out.append(self._line(node, ts, (
                    f"[rank{r}]:  iteration {step:8d}/  500000 | consumed samples: {step * 1024:12d} | elapsed time "
                    f"per iteration (ms): {ms:.1f} | learning rate: 3.000E-04 | global batch size:  1024 | lm loss: "
                    f"{2.9 * 0.9995 ** step:.6E} | loss scale: 1.0 | grad norm: 0.{self.rng.randint(100, 999)} |"), r))
                if self.rng.random() < 0.35:
                    out.append(self._line(node, ts, self.rng.choice(APP_LINES).format(r=r, s=step), r))
                out.append(self._sig(node, Source.PROGRESS, ts, ProgressSample(job, r, step, ms / 1000)))
                if self.rng.random() < 0.1:
                    out.append(self._sig(node, Source.KERNEL, ts, LogLine(
                        self.rng.choice(BENIGN_KERNEL).format(t=ts % 86400))))
                for name, base in (("DCGM_FI_DEV_GPU_TEMP", 62.0), ("DCGM_FI_DEV_POWER_USAGE", 640.0),
                                   ("DCGM_FI_DEV_GPU_UTIL", 97.0)):
                    if self.rng.random() < 0.6:  # the agent ships changes, not every sample
                        v = round(base + self.rng.uniform(-3, 3), 1)
                        out.append(self._sig(node, Source.DCGM, ts, MetricSample(
                            name, v, {"gpu": str(local), "pci": f"00000000:{PCI[local]}:00.0"})))
                if self.rng.random() < fault_p * 22:  # ~22 signals per rank and step: 0.1 % of signals
                    if self.rng.random() < 0.7:
                        text = self.rng.choice(FAULTS).format(b=PCI[local])
                        out.append(self._sig(node, Source.KERNEL, ts, LogLine(f"[{ts % 86400:.6f}] {text}")))
                    else:
                        out.append(self._line(node, ts, NCCL_ERROR.format(r=r), r))
            ts += 0.85
        return out

    def flood(self, job_index: int, ts: float) -> tuple[list[Signal], list[list[Signal]]]:
        """An Xid 79 on the job's fourth node; then each of the job's nodes ships its 8 ranks' NCCL timeouts."""
        first = job_index * JOB_NODES
        xid = [self._sig(first + 3, Source.KERNEL, ts, LogLine(f"[{ts % 86400:.6f}] {XID79}"))]
        per_node = []
        for node in range(first, first + JOB_NODES):
            lines = []
            for local in range(RANKS):
                r = (node - first) * RANKS + local
                lines.append(self._line(node, ts + 600 + self.rng.uniform(0, 2), (
                    f"[rank{r}]:[E1124 13:10:00.{self.rng.randint(0, 999999):06d} ProcessGroupNCCL.cpp:607] "
                    f"[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=8812, "
                    f"OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for "
                    f"{600000 + self.rng.randint(5, 99)} milliseconds before timing out."), r))
            per_node.append(lines)
        return xid, per_node


def make_bodies(batches: int, size: int, seed: int, start: float) -> tuple[list[bytes], int, int]:
    """The gzip bodies, in order: (bodies, signals, fault lines)."""
    fleet = Fleet(seed)
    bodies: list[bytes] = []
    signals = faults = 0
    xid, flood = fleet.flood(5, start)
    flood_at = batches // 2
    seqs: dict[int, int] = {}
    for i in range(batches):
        node = (i * 37) % NODES
        sigs = fleet.batch(node, start + i * 0.01, size, 0.001)
        if i == flood_at:
            sigs += xid
        elif flood_at < i <= flood_at + len(flood):
            sigs += flood[i - flood_at - 1]
        signals += len(sigs)
        faults += sum(1 for s in sigs if isinstance(s.payload, LogLine)
                      and ("Xid" in s.payload.text or "NCCL" in s.payload.text))
        seqs[node] = seqs.get(node, 0) + 1  # each node's agent numbers its own batches
        bodies.append(encode_batch(sigs, producer=f"gpu-node-{node:04d}/bench", seq=seqs[node]))
    return bodies, signals, faults


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server(argv: list[str], port: int, log: Path, env: dict[str, str], ready: str) -> Iterator[tuple[str, int]]:
    """A server process; yields its URL and pid once `ready` answers 200."""
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=os.environ | env)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv} exited: {log.read_text()[-2000:]}")
                try:
                    if httpx.get(url + ready, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{argv} not ready")
                time.sleep(0.1)
            yield url, proc.pid
        finally:
            proc.send_signal(signal.SIGINT)  # as Ctrl-C: uvicorn (and a profiler wrapped around it) end cleanly
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def post_all(url: str, bodies: list[bytes], clients: int, token: str | None) -> tuple[float, list[float], int]:
    """Post every body with `clients` threads; returns (seconds, latencies in the bodies' order, errors)."""
    todo: queue.Queue[tuple[int, bytes]] = queue.Queue()
    for i, b in enumerate(bodies):
        todo.put((i, b))
    lat = [0.0] * len(bodies)
    errors = [0]
    lock = threading.Lock()
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    def work() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while True:
                try:
                    i, body = todo.get_nowait()
                except queue.Empty:
                    return
                t = time.perf_counter()
                r = c.post("/v1/signals", content=body, headers=headers)
                lat[i] = time.perf_counter() - t
                with lock:
                    errors[0] += not r.is_success

    threads = [threading.Thread(target=work) for _ in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0, lat, errors[0]


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def floor_app() -> None:
    """The HTTP floor: read the body, gunzip it, answer. Run as ``bench/ingest.py --floor-server PORT``."""
    import uvicorn

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        assert scope["type"] in ("http", "lifespan")
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()  # type: ignore[operator]
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})  # type: ignore[operator]
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})  # type: ignore[operator]
                    return
        chunks = []
        more = True
        while more:
            msg = await receive()  # type: ignore[operator]
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        n = len(gzip.decompress(raw)) if raw else 0
        out = json.dumps({"bytes": n}).encode()
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})  # type: ignore[operator]

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")


def measure(tree: Path, bodies: list[bytes], db: Path, tmp: Path, args: argparse.Namespace) -> dict[str, object]:
    """`kmend serve` run from `tree` (this checkout or another) on a copy of the filled store: its figures."""
    run_db = tmp / f"run-{time.monotonic_ns()}.db"
    if db.exists():
        shutil.copy(db, run_db)
    port = free_port()
    env = {"KMEND_SYMPTOM_SETTLE_S": "3600", "KMEND_SIM_NODES": "16", "KMEND_STORE_LINES": args.store_lines,
           "PYTHONPATH": str(tree)}
    argv = [*_pin(args.core), sys.executable, "-m", "kmend.cli", "serve", "--port", str(port),
            "--database-url", f"sqlite:///{run_db}", "--cluster", "sim"]
    with server(argv, port, tmp / "serve.log", env, "/readyz") as (url, pid):
        cpu0 = cpu_s(pid)
        dt, lat, errors = post_all(url, bodies, args.clients, None)
        cpu = cpu_s(pid) - cpu0
        incidents = httpx.get(url + "/v1/incidents", params={"node": "gpu-node-0323"}, timeout=60).json()
        flood = [httpx.get(f"{url}/v1/incidents/{i['id']}", timeout=60).json() for i in incidents["incidents"]
                 if i.get("fault_class") == "gpu_lost"]
        replay_dt, _, _ = post_all(url, bodies[:50], args.clients, None)
    n = args.signals
    # The start-up figure: the first batches (one per client, posted as the service became ready) against the p50 of
    # the batches after the first few rounds of clients.
    first, warm = lat[:args.clients], lat[4 * args.clients:]
    return {"tree": str(tree), "seconds": round(dt, 2), "signals_per_s": round(n / dt),
            "p50_ms": round(_pct(lat, 0.5) * 1000), "p99_ms": round(_pct(lat, 0.99) * 1000), "errors": errors,
            "first_batches_ms": round(_pct(first, 0.5) * 1000), "warm_p50_ms": round(_pct(warm, 0.5) * 1000),
            "first_over_warm_p50": round(_pct(first, 0.5) / _pct(warm, 0.5), 2),
            "cpu_s": round(cpu, 2), "signals_per_cpu_s": round(n / cpu) if cpu else None,
            "cpu_us_per_signal": round(cpu / n * 1e6, 1), "replayed_batches_per_s": round(50 / replay_dt),
            "flood_incidents": len(flood), "flood_findings": len(flood[0]["findings"]) if flood else 0}


def run(args: argparse.Namespace) -> None:
    start = time.time() - 3600
    bodies, n, faults = make_bodies(args.batches, args.batch, args.seed, start)
    args.signals = n
    sizes = [len(b) for b in bodies]
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "kmend.db"
        t = time.perf_counter()
        if args.history:
            from bench.restart import fill
            fill(db, args.history, open_incidents=100, flood=0)
        fill_s = time.perf_counter() - t
        this = Path(args.serve_from).resolve() if args.serve_from else REPO
        runs: dict[str, list[dict[str, object]]] = {"this": []}
        if args.compare:
            runs["other"] = []
        for r in range(args.rounds):
            # Interleaved, the order swapped each round: both trees see the same machine, as near as can be.
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for label in order:
                tree = this if label == "this" else Path(args.compare).resolve()
                runs[label].append(measure(tree, bodies, db, Path(tmp), args))
        floor_port = free_port()
        with server([*_pin(args.core), sys.executable, str(Path(__file__).resolve()), "--floor-server",
                     str(floor_port)], floor_port, Path(tmp) / "floor.log",
                    {"PYTHONPATH": str(REPO)}, "/") as (url, pid):
            cpu0 = cpu_s(pid)
            fdt, flat, ferrors = post_all(url, bodies, args.clients, None)
            fcpu = cpu_s(pid) - cpu0
    out: dict[str, object] = {
        "bench": "ingest_http", "signals": n, "batches": len(bodies), "signals_per_batch": n // len(bodies),
        "fault_lines": faults, "gzip_kb_per_batch": round(sum(sizes) / len(sizes) / 1024, 1),
        "clients": args.clients, "pinned_core": args.core, "history_findings": args.history,
        "fill_s": round(fill_s, 1), "store_lines": args.store_lines,
        "kmend": runs["this"][0] if args.rounds == 1 and not args.compare else runs["this"],
        "floor": {"seconds": round(fdt, 2), "signals_per_s": round(n / fdt),
                  "p50_ms": round(_pct(flat, 0.5) * 1000), "p99_ms": round(_pct(flat, 0.99) * 1000),
                  "errors": ferrors, "cpu_s": round(fcpu, 2), "signals_per_cpu_s": round(n / fcpu) if fcpu else None},
    }
    if args.compare:
        out["other"] = runs["other"]
        out["this_over_other"] = [{"signals_per_cpu_s": round(a["signals_per_cpu_s"] / b["signals_per_cpu_s"], 2),  # type: ignore[operator]
                                   "signals_per_s": round(a["signals_per_s"] / b["signals_per_s"], 2),  # type: ignore[operator]
                                   "p99": round(a["p99_ms"] / b["p99_ms"], 2),  # type: ignore[operator]
                                   "first_batches": round(a["first_batches_ms"] / b["first_batches_ms"], 2)}  # type: ignore[operator]
                                  for a, b in zip(runs["this"], runs["other"], strict=True)]
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--floor-server":
        floor_app()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1000, help="signals per batch (about)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--history", type=int, default=200_000, help="findings already stored (a month, 1,000 nodes)")
    ap.add_argument("--core", type=int, default=0, help="pin each server to this core (-1: no pinning)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--store-lines", choices=["all", "evidence"], default="all", help="KMEND_STORE_LINES")
    ap.add_argument("--serve-from", default="", metavar="DIR", help="run `kmend serve` from this source tree")
    ap.add_argument("--compare", default="", metavar="DIR",
                    help="also run `kmend serve` from DIR (an older checkout), interleaved with this tree, same bodies")
    ap.add_argument("--rounds", type=int, default=1, help="measurements of each tree (interleaved with --compare)")
    args = ap.parse_args()
    if args.core < 0:
        args.core = None
    run(args)


if __name__ == "__main__":
    main()
