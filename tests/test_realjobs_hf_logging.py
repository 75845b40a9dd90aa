"""A Hugging Face Trainer run as a user runs it: the loss dict every 10 steps (``logging_steps=10``) and the default
tqdm bar, only rank 0 printing, through `kmend agent` and `kmend serve` as separate processes: a rank stopped from
outside is a hang within the target, and a run that ends raises nothing afterwards."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realjob import Job, Kmend, of_class, running_kmend

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.realjob, pytest.mark.timeout(180)]

HANG_TARGET_S = 15.0
"""Hang named this long after the last progress, for steps under 2 s (the issue's target)."""
LOGGING = ("10",)
"""The Trainer's ``logging_steps``."""


@pytest.fixture
def kmend(tmp_path: Path) -> Iterator[Kmend]:
    with running_kmend(tmp_path) as k:
        yield k


def _last_progress(job: Job) -> tuple[int, int, float]:
    """Rank 0's log as written: the bar's newest step, the loss dicts, and when the last record holding either was
    written (the bar redraws with carriage returns, so its record is written when a line ends it or it fills
    16 KiB, as the container runtime writes it)."""
    from collector.sources.cri import TimestampParser

    parse = TimestampParser()
    bar, dicts, last = 0, 0, 0.0
    for line in job.pods[0].text().split("\n"):
        steps = [int(m) for m in re.findall(r"\| *(\d+)/\d+ \[", line)]
        bar = max([bar, *steps])
        dicts += "'loss': " in line
        if steps or "'loss': " in line:
            last = max(last, parse(line.split(" ", 1)[0]) or 0.0)
    return bar, dicts, last


def test_hf_trainer_logging_every_10_steps_ends_without_an_incident(kmend: Kmend) -> None:
    job = Job(kmend.pods, "gpt2-log10", "hf_trainer.py", steps=60, world=2, args=LOGGING)
    try:
        assert job.wait(120) == [0, 0], job.output()
    finally:
        job.stop()
    # Rank 0's loss dicts (one every 10 steps) reach the service as lines; its bar drew every step to 60.
    assert len(kmend.stored_lines("'loss': ")) == 6 and _last_progress(job)[0] == 60
    deadline = time.monotonic() + 30
    while kmend.progress_received() < 1:
        assert time.monotonic() < deadline, "no progress reached the service"
        time.sleep(0.25)
    time.sleep(12.0)  # past the hang floor the service runs with
    assert kmend.incidents() == []


def test_hf_trainer_logging_every_10_steps_blocked_rank_is_a_hang_within_the_target(kmend: Kmend) -> None:
    fault = {"KMEND_FAULT": "stop", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "1500"}
    job = Job(kmend.pods, "gpt2-log10-hang", "hf_trainer.py", steps=100_000, world=2, fault=fault, args=LOGGING)
    try:
        incs = kmend.wait_for(lambda i: bool(of_class(i, "hang")), 120)
        found = time.time()
        _, dicts, last = _last_progress(job)
    finally:
        job.stop()
    [hang] = of_class(incs, "hang")
    assert hang["root_cause"]["job"] == "gpt2-log10-hang" and dicts >= 140
    assert found - last <= HANG_TARGET_S + 1.0, found - last
    assert of_class(incs, "straggler") == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after", [15, 25])
def test_hf_trainer_stopped_before_its_third_loss_dict_is_a_hang_within_the_target(kmend: Kmend, after: int) -> None:
    # Rank 1 stops in step 16 (one loss dict printed, at step 10) or step 26 (two: 10 and 20): too few reports to
    # know the job's pace, so the hang is called when the stacks the agent takes in the silence show it stuck.
    fault = {"KMEND_FAULT": "stop", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": str(after)}
    job = Job(kmend.pods, f"gpt2-early{after}", "hf_trainer.py", steps=100_000, world=2, fault=fault, args=LOGGING)
    try:
        incs = kmend.wait_for(lambda i: bool(of_class(i, "hang")), 90)
        found = time.time()
        _, dicts, last = _last_progress(job)
    finally:
        job.stop()
    hangs = of_class(incs, "hang")
    assert hangs, job.output()
    assert hangs[0]["root_cause"]["job"] == f"gpt2-early{after}" and dicts == after // 10
    called = [f["fields"] for f in hangs[0].get("findings", []) if f.get("rule_id") == "hang-detector"]
    print(f"hang after {dicts} loss dict(s): incident {found - last:.1f} s after the last one; called {called}")
    assert found - last <= HANG_TARGET_S + 1.0, found - last
    assert of_class(incs, "straggler") == []
