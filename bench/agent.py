"""Agent cost: CPU and peak RSS of `kmend agent` tailing 10,000 lines/s across 64 container logs.

Prints one JSON object. The agent runs as its own process with the default
prefilter (shipped rule packs) and ships to a minimal loopback sink; the
writer and the sink run in this process and are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
FAULT = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Sink(BaseHTTPRequestHandler):
    """Accepts every batch, as a fast service would."""

    posts = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        Sink.posts += 1
        body = b'{"accepted": 0}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def metric(port: int, name: str) -> float:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--rate", type=int, default=10_000, help="lines per second, all files together")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--fault-every", type=int, default=1000, help="one rule-matching line per N")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kmend-bench-agent-"))
    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    pods = tmp / "pods"
    files = []
    for i in range(args.files):
        d = pods / f"train_llama-worker-{i}_uid-{i:04d}" / "trainer"
        d.mkdir(parents=True)
        files.append(open(d / "0.log", "a", buffering=1 << 16))  # noqa: SIM115 - closed in finally
    status = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "kmend.cli", "agent", "--node", "bench-node",
         "--service-url", f"http://127.0.0.1:{sink.server_address[1]}", "--state-dir", str(tmp / "state"),
         "--pods-root", str(pods), "--kernel", "off", "--ib-root", str(tmp / "no-ib"), "--no-nvml",
         "--no-pod-labels", "--status-port", str(status), "--status-host", "127.0.0.1"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    written = faults = 0
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{status}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or agent.poll() is not None:
                    raise RuntimeError("agent did not start") from None
                time.sleep(0.1)
        tick = 0.05
        per_tick = max(1, int(args.rate * tick))
        start = time.monotonic()
        measured_from = start + args.warmup
        end = measured_from + args.seconds
        cpu0 = wall0 = None
        n = 0
        while time.monotonic() < end:
            now = time.monotonic()
            if cpu0 is None and now >= measured_from:
                cpu0, wall0 = cpu_seconds(agent.pid), now
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
            for _ in range(per_tick):
                n += 1
                fh = files[n % len(files)]
                if n % args.fault_every == 0:
                    fh.write(f"{stamp}.{n % 10**9:09d}Z stderr F {FAULT} #{n}\n")
                    faults += 1
                else:
                    # Filler no fault or progress rule matches (step lines are shipped, and come
                    # once per step, not thousands per second).
                    fh.write(f"{stamp}.{n % 10**9:09d}Z stdout F data/shard_{n % 512:04d}.bin: read 64 samples, "
                             f"tokens/s 182344 grad_norm 0.91\n")
                written += 1
            for fh in files:
                fh.flush()
            next_tick = start + tick * (n // per_tick)
            time.sleep(max(0.0, next_tick - time.monotonic()))
        assert cpu0 is not None and wall0 is not None
        cpu1, wall1 = cpu_seconds(agent.pid), time.monotonic()
        time.sleep(1.5)  # let the agent finish what was written
        read = metric(status, "kmend_agent_lines_read_total")
        shipped = metric(status, "kmend_agent_signals_shipped_total")
        result = {
            "bench": "agent_tail",
            "files": args.files,
            "target_lines_per_s": args.rate,
            "achieved_lines_per_s": round(written / (wall1 - start), 1),
            "measured_s": round(wall1 - wall0, 2),
            "lines_written": written,
            "lines_read": int(read),
            "fault_lines": faults,
            "signals_shipped": int(shipped),
            "agent_cpu_percent_of_one_core": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 2),
            "agent_peak_rss_mb": round(peak_rss_mb(agent.pid), 1),
            "targets": {"cpu_percent": 5, "rss_mb": 100},
        }
        print(json.dumps(result))
    finally:
        agent.terminate()
        agent.wait(timeout=15)
        for fh in files:
            fh.close()
        sink.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
