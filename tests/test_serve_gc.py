"""A running `kmend serve` takes batches without the garbage collector running through them: its own /metrics show
the collections (and CPU seconds) of the process while real agent batches arrive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from collector.shipper import encode_batch
from collector.signal import ProgressSample, Signal, Source
from tests.builders import container
from tests.conftest import free_port
from tests.procs import wait_ready

REPO = Path(__file__).resolve().parent.parent


def _sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = next(x for x in text.splitlines() if x.startswith(f"{name}{{{want}}}" if want else f"{name} "))
    return float(line.rsplit(" ", 1)[1])


def test_a_thousand_signal_batch_costs_no_collection_of_the_services_heap(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KMEND_")}
    env.update({"KMEND_PORT": str(port), "KMEND_CLUSTER": "sim",
                "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"})
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve"], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log=log)
        with httpx.Client(base_url=url, timeout=120) as c:
            before = c.get("/metrics").text
            for b in range(10):
                sigs = []
                for i in range(125):
                    step = b * 125 + i
                    for r in range(4):
                        text = (f"[rank{r}]:  iteration {step:8d}/  500000 | elapsed time per iteration (ms): "
                                f"851.{r} | lm loss: 2.1E+00 |")
                        sigs.append(container(f"gpu-node-{r:02d}", text, job="llm", rank=r,
                                              ts=1_700_000_000.0 + step))
                        sigs.append(Signal(f"gpu-node-{r:02d}/progress/{step}", f"gpu-node-{r:02d}", Source.PROGRESS,
                                           1_700_000_000.0 + step, ProgressSample("llm", r, step, 0.85)))
                body = encode_batch(sigs, producer="gpu-node-00/gc", seq=b + 1)
                got = c.post("/v1/signals", content=body, headers={"Content-Encoding": "gzip",
                                                                   "Content-Type": "application/json"})
                assert got.status_code == 200 and got.json()["accepted"] == 1000, got.text
            after = c.get("/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    young = _sample(after, "python_gc_collections_total", generation="0") \
        - _sample(before, "python_gc_collections_total", generation="0")
    old = _sample(after, "python_gc_collections_total", generation="2") \
        - _sample(before, "python_gc_collections_total", generation="2")
    # At the interpreter's default threshold this was about 8 young collections per batch (80 here), and the
    # odd full one through everything the service keeps; the threshold the service sets makes it one or two.
    assert young <= 5, young
    assert old == 0, old
    assert _sample(after, "process_cpu_seconds_total") > 0
