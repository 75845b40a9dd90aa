"""Unmodified trainers (a plain DDP loop, the Hugging Face Trainer, Lightning) on CPU with gloo, one pod per rank
written as CRI files, watched by `kmend agent` and `kmend serve` as separate processes; faults come from outside
(a sleep or a SIGSTOP injected through `sitecustomize` on one rank's PYTHONPATH, an exception raised the same way)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.realjob import NODE, Job, Kmend, of_class, running_kmend

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.realjob, pytest.mark.timeout(150)]

HANG_TARGET_S = 15.0
"""Hang named this long after the last progress, for steps under 2 s (the issue's target)."""


@pytest.fixture
def kmend(tmp_path: Path) -> Iterator[Kmend]:
    with running_kmend(tmp_path) as k:
        yield k


def _last_progress(job: Job, needle: str) -> float:
    """When the last line holding `needle` was written (CRI time of the newest such record)."""
    from collector.sources.cri import TimestampParser

    parse = TimestampParser()
    last = 0.0
    for pod in job.pods:
        for line in pod.text().split("\n"):  # not splitlines(): a bar's redraws are separated by \r
            if needle in line:
                last = max(last, parse(line.split(" ", 1)[0]) or 0.0)
    return last


def _assert_nothing_cordoned(k: Kmend) -> None:
    nodes = k.nodes()
    assert not [n for n, v in nodes.items() if v["cordoned"] or v["fault"]], nodes


# -- a plain DDP loop ----------------------------------------------------------------------------------------


def test_plain_ddp_healthy_run_raises_nothing_while_it_runs_nor_after_it_ends(kmend: Kmend) -> None:
    # No end line, no API, the pods' log directories stay: the agent sees the ranks' processes end.
    job = Job(kmend.pods, "ddp-ok", "plain_ddp.py", steps=150, world=3)
    try:
        assert job.wait(90) == [0, 0, 0], job.output()
    finally:
        job.stop()
    time.sleep(1.5)  # the agent's last poll and a detector round
    # Every rank's progress reached the service, summarised on the node (no step line is shipped), and none of
    # it looked like a fault.
    assert kmend.stored_lines("step ") == [] and kmend.progress_received() >= 3
    assert kmend.incidents() == []
    time.sleep(10.5)  # past the hang floor the service runs with
    assert kmend.incidents() == []


def test_plain_ddp_slowed_rank_is_named_a_straggler(kmend: Kmend) -> None:
    fault = {"KMEND_FAULT": "slow", "KMEND_FAULT_RANK": "2", "KMEND_FAULT_AFTER": "5", "KMEND_FAULT_SLOW_S": "0.15"}
    job = Job(kmend.pods, "ddp-slow", "plain_ddp.py", steps=80, world=4, fault=fault)
    try:
        incs = kmend.wait_for(lambda i: bool(of_class(i, "straggler")), 100, job)
    finally:
        job.stop()
    [inc] = of_class(incs, "straggler")
    assert (inc["root_cause"]["rank"], inc["root_cause"]["node"], inc["root_cause"]["job"]) == (2, NODE, "ddp-slow")
    [f] = [f for f in inc["findings"] if f["fault_class"] == "straggler"]
    assert f["fields"]["basis"] == "arrival_lag"
    assert int(f["fields"]["step"]) - 5 <= 30, f["fields"]  # named within 30 steps of the slowdown
    assert of_class(incs, "hang") == []


def _hang_with_stacks(incidents: list[dict[str, Any]]) -> bool:
    """A hang incident with the ranks' stacks in it: they follow the hang call by a poll or two."""
    return any(f["rule_id"] == "stack-dump" for i in of_class(incidents, "hang") for f in i["findings"])


def _assert_stopped_rank_named(hang: dict[str, Any], rank: int) -> None:
    named = [(f["rule_id"], f["fields"].get("culprit_rank"), f["message"]) for f in hang["findings"]]
    assert hang["root_cause"]["rank"] == rank, (hang["root_cause"], named)
    # Named from the agent's look at the processes: py-spy stacks of every rank, the culprit's process stopped.
    [stacks] = [f for f in hang["findings"] if f["rule_id"] == "stack-dump"]
    assert stacks["fields"]["stopped_ranks"] == str(rank), stacks["fields"]
    assert "Thread " in stacks["fields"]["culprit_stack"], stacks["fields"]["culprit_stack"]


def test_plain_ddp_blocked_rank_is_a_hang_named_within_the_target(kmend: Kmend) -> None:
    # Rank 1 stops at its forward pass after step 20: the others finish step 20 too and wait
    # in the gradient all-reduce, so every rank's last line is the same step.
    fault = {"KMEND_FAULT": "stop", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "20"}
    job = Job(kmend.pods, "ddp-named", "plain_ddp.py", steps=100_000, world=3, fault=fault)
    try:
        incs = kmend.wait_for(_hang_with_stacks, 60)
        found = time.time()
        last = _last_progress(job, " stdout F step ")
    finally:
        job.stop()
    [hang] = of_class(incs, "hang")
    assert hang["root_cause"]["job"] == "ddp-named"
    _assert_stopped_rank_named(hang, 1)
    assert found - last <= HANG_TARGET_S + 1.0, found - last
    print(f"hang called and rank 1 named {found - last:.1f} s after the last progress line")


def test_plain_ddp_crash_is_an_application_incident_on_that_rank(kmend: Kmend) -> None:
    fault = {"KMEND_FAULT": "crash", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "10"}
    job = Job(kmend.pods, "ddp-crash", "plain_ddp.py", steps=100_000, world=2, fault=fault)
    try:
        job.wait(60)
        incs = kmend.wait_for(lambda i: any(x["fault_class"] == "app_error" for x in i), 30)
        time.sleep(2.0)  # past the symptom settle time: the healer has decided
        incs = kmend.incidents()
    finally:
        job.stop()
    apps = of_class(incs, "app_error")
    assert apps, [(i["fault_class"], i["root_cause"]) for i in incs]
    assert {a["root_cause"]["rank"] for a in apps} == {1}
    assert all(not a["hardware"] and a["recommended_action"] == "fix_application" for a in apps)
    _assert_nothing_cordoned(kmend)


# -- Hugging Face Trainer ------------------------------------------------------------------------------------


def test_hf_trainer_healthy_run_raises_nothing(kmend: Kmend) -> None:
    job = Job(kmend.pods, "gpt2-ok", "hf_trainer.py", steps=60, world=2)
    try:
        assert job.wait(100) == [0, 0], job.output()
    finally:
        job.stop()
    assert len(kmend.stored_lines("'loss': ")) >= 50  # only the main process prints them
    time.sleep(1.5)
    assert kmend.incidents() == []
    # The Trainer's bar printed the run's total and reached it: the job finished, its silence is no hang.
    time.sleep(11.0)
    assert kmend.incidents() == []


def test_hf_trainer_rank_with_a_stalled_data_loader_is_slow_not_hung(kmend: Kmend) -> None:
    # Rank 1's data loader takes 25 s for one batch (storage that stalls, then recovers) while rank 0 waits in
    # the gradient all-reduce: a silence past the hang threshold (10 s floor here), shorter than the hold.
    fault = {"KMEND_FAULT": "stall_loader", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "15",
             "KMEND_FAULT_STALL_S": "25"}
    job = Job(kmend.pods, "gpt2-stall", "hf_trainer.py", steps=40, world=2, fault=fault)
    try:
        # Until the Trainer reports its run done. Its launchers' exit is not waited for: a worker that leaves without
        # destroying its gloo process group may abort in its teardown ("terminate called without an active
        # exception"), and the other node's launcher then waits in torchrun's exit barrier for minutes.
        deadline = time.monotonic() + 140
        while "'train_runtime'" not in job.pods[0].text():
            assert time.monotonic() < deadline, job.output()
            time.sleep(0.2)
        time.sleep(1.0)  # the agent's last poll of the run's lines
    finally:
        job.stop()
    time.sleep(1.5)
    # The silence was judged: the ranks' stacks were taken, rank 1's in the DataLoader, and held the call.
    with sqlite3.connect(kmend.db) as conn:
        asked = conn.execute("SELECT count(*) FROM node_requests WHERE kind = 'stack_dump'").fetchone()[0]
    assert asked >= 1
    assert of_class(kmend.incidents(), "hang") == []


def test_hf_trainer_blocked_rank_is_a_hang_named_within_the_target(kmend: Kmend) -> None:
    # Only the main process prints progress: rank 1 is known from its process alone.
    fault = {"KMEND_FAULT": "stop", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "5"}
    job = Job(kmend.pods, "gpt2-named", "hf_trainer.py", steps=100_000, world=2, fault=fault)
    try:
        incs = kmend.wait_for(_hang_with_stacks, 100)
        found = time.time()
        last = _last_progress(job, "'loss': ")
    finally:
        job.stop()
    [hang] = of_class(incs, "hang")
    assert hang["root_cause"]["job"] == "gpt2-named"
    _assert_stopped_rank_named(hang, 1)
    assert found - last <= HANG_TARGET_S + 1.0, found - last
    print(f"hang called and rank 1 named {found - last:.1f} s after the last progress line")


# -- Lightning -----------------------------------------------------------------------------------------------

# Lightning draws its default (Rich) bar only on a terminal; a pod that wants it in its log says so.
RICH_IN_POD = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}


def test_lightning_healthy_run_raises_nothing(kmend: Kmend) -> None:
    job = Job(kmend.pods, "pl-ok", "lightning_trainer.py", steps=150, world=2, env=RICH_IN_POD)
    try:
        assert job.wait(100) == [0, 0], job.output()
    finally:
        job.stop()
    time.sleep(1.5)
    assert len(kmend.stored_lines("Epoch 0/")) >= 10
    assert kmend.incidents() == []


def test_lightning_blocked_rank_is_a_hang(kmend: Kmend) -> None:
    fault = {"KMEND_FAULT": "stop", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "40"}
    job = Job(kmend.pods, "pl-hang", "lightning_trainer.py", steps=100_000, world=2, fault=fault, env=RICH_IN_POD)
    try:
        incs = kmend.wait_for(lambda i: bool(of_class(i, "hang")), 100)
        found = time.time()
        last = _last_progress(job, "Epoch 0/")
    finally:
        job.stop()
    [hang] = of_class(incs, "hang")
    assert hang["root_cause"]["job"] == "pl-hang"
    assert found - last <= HANG_TARGET_S + 1.0, found - last
