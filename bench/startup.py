"""`kmend serve` start-up: seconds and CPU seconds to ready, and resident memory when idle. Prints one JSON object.

Runs `kmend serve --cluster sim` on an empty SQLite file as a process, polls `/readyz`, reads the
process's CPU time and RSS from /proc at ready and again after `--idle` seconds with nothing to do.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _cpu_rss(pid: int) -> tuple[float, float]:
    """(CPU seconds, RSS MB) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return cpu, rss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=float, default=10.0)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "kmend.cli", "serve", "--port", str(port), "--database-url",
                f"sqlite:///{Path(tmp) / 'k.db'}", "--cluster", "sim"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("kmend serve exited")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.02)
            ready_s = time.perf_counter() - t0
            cpu_ready, rss_ready = _cpu_rss(proc.pid)
            time.sleep(args.idle)
            cpu_idle, rss_idle = _cpu_rss(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    print(json.dumps({"bench": "serve_startup", "ready_s": round(ready_s, 2), "cpu_s_to_ready": round(cpu_ready, 2),
                      "rss_mb_at_ready": round(rss_ready), "idle_s": args.idle, "rss_mb_idle": round(rss_idle),
                      "cpu_s_while_idle": round(cpu_idle - cpu_ready, 2)}))


if __name__ == "__main__":
    main()
