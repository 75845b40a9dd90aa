"""A real `kmend agent` summarising a job's hook progress and a real `kmend serve`: the service receives one record
per rank per window instead of every step's sample, and still names the slow rank and then the job's hang."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collector.progress_hook import ProgressReporter
from tests.conftest import REPO, free_port
from tests.procs import wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKEN = "ingest-t"
HEADERS = {"authorization": "Bearer op-t"}
WORLD, SLOW, STEPS, STEP_S = 8, 5, 100, 0.1


def _until(what: str, pred: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = pred()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _progress_received(url: str) -> float:
    body = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == "kmend_ingest_signals_total" and s.labels.get("source") == "progress")


def _incidents(url: str, fault_class: str) -> list[dict[str, Any]]:
    got = httpx.get(f"{url}/v1/incidents", headers=HEADERS, timeout=5).json()["incidents"]
    return [i for i in got if i["fault_class"] == fault_class]


def test_summarised_progress_still_shows_the_straggler_and_the_hang(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (tmp_path / "token").write_text(TOKEN + "\n")
    env = {**os.environ, "KMEND_INGEST_TOKEN": TOKEN, "KMEND_OPERATOR_TOKEN": "op-t", "KMEND_READER_TOKEN": "r-t",
           "KMEND_HANG_FLOOR_S": "3", "KMEND_DETECTOR_INTERVAL_S": "0.2"}
    logs = {n: (tmp_path / f"{n}.log").open("wb") for n in ("serve", "agent")}
    serve = subprocess.Popen([sys.executable, "-m", "kmend.cli", "serve", "--port", str(port), "--database-url",
                              f"sqlite:///{tmp_path / 'k.db'}", "--cluster", "sim"], cwd=REPO, env=env,
                             stdout=logs["serve"], stderr=subprocess.STDOUT)
    progress = tmp_path / "progress"
    agent = subprocess.Popen([sys.executable, "-m", "kmend.cli", "agent", "--node", "gpu-node-01", "--service-url",
                              url, "--token-file", str(tmp_path / "token"), "--state-dir", str(tmp_path / "state"),
                              "--pods-root", str(tmp_path / "pods"), "--kernel", "off", "--ib-root",
                              str(tmp_path / "no-ib"), "--no-nvml", "--no-pod-labels", "--no-node-requests",
                              "--no-stacks", "--no-process-exits", "--status-port", "0", "--progress-dir",
                              str(progress), "--progress-summary-s", "1", "--poll-interval", "0.1",
                              "--flush-interval", "0.2"], cwd=REPO, env=env, stdout=logs["agent"],
                             stderr=subprocess.STDOUT)
    try:
        wait_ready(url, serve, log=tmp_path / "serve.log")
        reporters = [ProgressReporter(progress, "llama", r, world_size=WORLD) for r in range(WORLD)]
        rng = random.Random(4)
        started = time.monotonic()
        for step in range(1, STEPS + 1):
            now = time.time()
            for r, rep in enumerate(reporters):
                compute = STEP_S * (1.3 if r == SLOW and step > 20 else 0.8) * rng.uniform(0.97, 1.03)
                rep.report_step(step, STEP_S, {"compute": compute, "comm_wait": STEP_S - compute}, ts=now)
            # Real time: the agent's windows close on its own clock (a loaded machine only makes steps longer).
            time.sleep(max(0.0, started + step * STEP_S - time.monotonic()))
        for rep in reporters:
            rep.close()
        written = WORLD * STEPS

        [straggler] = _until("the slow rank's incident", lambda: _incidents(url, "straggler"))
        assert straggler["root_cause"]["rank"] == SLOW, straggler
        # The job stops stepping: one hang, from summaries alone.
        _until("the job's hang", lambda: _incidents(url, "hang"), timeout=60)
        received = _until("every window shipped", lambda: _progress_received(url) or None)
        assert received <= written / 4, f"{received} progress records for {written} steps: not summarised"
    except AssertionError as exc:
        tails = "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text(errors='replace')[-3000:]}" for n in logs)
        raise AssertionError(f"{exc}\n{tails}") from None
    finally:
        for p in (agent, serve):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for fh in logs.values():
            fh.close()
