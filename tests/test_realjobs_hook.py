"""A plain DDP loop that reports its steps through kmend's hook (and prints none), on CPU with gloo under torchrun,
watched by `kmend agent` (reading the hook's files at its default summary window) and `kmend serve` as separate
processes: a rank slowed from outside is named within 30 steps, a healthy run that finishes raises nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realjob import NAMESPACE, NODE, Job, Kmend, of_class, running_kmend

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.realjob, pytest.mark.timeout(150)]


@pytest.fixture
def progress(tmp_path: Path) -> Path:
    d = tmp_path / "progress"
    d.mkdir()
    return d


@pytest.fixture
def kmend(tmp_path: Path, progress: Path) -> Iterator[Kmend]:
    with running_kmend(tmp_path, agent_args=("--progress-dir", str(progress))) as k:
        yield k


def _env(progress: Path) -> dict[str, str]:
    # As in a pod: the hook's directory shared with the agent, the namespace from the downward API.
    return {"KMEND_PROGRESS_DIR": str(progress), "POD_NAMESPACE": NAMESPACE}


def test_hook_ddp_slowed_rank_is_named_within_30_steps(kmend: Kmend, progress: Path) -> None:
    # Rank 2 sleeps 0.15 s after each optimizer step from step 6 on: every step waits for it in the all-reduce, so
    # every rank's step time is the same; only its reports come later than its peers'.
    fault = {"KMEND_FAULT": "slow", "KMEND_FAULT_RANK": "2", "KMEND_FAULT_AFTER": "5", "KMEND_FAULT_SLOW_S": "0.15"}
    job = Job(kmend.pods, "hook-slow", "hook_ddp.py", steps=200, world=4, fault=fault, env=_env(progress))
    try:
        incs = kmend.wait_for(lambda i: bool(of_class(i, "straggler")), 100, job)
    finally:
        job.stop()
    assert kmend.stored_lines("step ") == [] and kmend.progress_received() >= 4
    [inc] = of_class(incs, "straggler")
    assert (inc["root_cause"]["rank"], inc["root_cause"]["node"], inc["root_cause"]["job"]) == \
        (2, NODE, "hook-slow"), inc["root_cause"]
    [f] = [f for f in inc["findings"] if f["fault_class"] == "straggler"]
    assert f["fields"]["basis"] == "arrival_lag", f["fields"]
    assert int(f["fields"]["step"]) - 5 <= 30, f["fields"]  # named within 30 steps of the slowdown
    assert of_class(incs, "hang") == []


def test_hook_ddp_healthy_run_that_finishes_raises_nothing(kmend: Kmend, progress: Path) -> None:
    job = Job(kmend.pods, "hook-ok", "hook_ddp.py", steps=300, world=3, env=_env(progress))
    try:
        assert job.wait(100) == [0, 0, 0], job.output()
    finally:
        job.stop()
    deadline = time.monotonic() + 60
    while kmend.progress_received() < 3:  # every rank's reports reached the service
        assert time.monotonic() < deadline, "no progress reached the service"
        time.sleep(0.25)
    time.sleep(12.0)  # past the hang floor the service runs with
    assert kmend.incidents() == []
