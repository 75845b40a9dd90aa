"""A real torchrun job (the plain DDP loop, gloo on CPU) whose rank 1 is stopped from outside at its first forward
pass, so that no rank ever prints a step line: known to the service only by the processes `kmend agent` sees start,
it is a hang once the stacks taken in its silence show the stopped rank (the old main: nothing)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from analyzer.detectors.hang import HangConfig
from tests.realjob import Job, Kmend, of_class, running_kmend

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.realjob, pytest.mark.timeout(150)]


@pytest.fixture
def kmend(tmp_path: Path) -> Iterator[Kmend]:
    with running_kmend(tmp_path) as k:
        yield k


def test_a_rank_stopped_before_the_first_step_line_is_a_hang(kmend: Kmend) -> None:
    fault = {"KMEND_FAULT": "stop", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "0"}
    begun = time.time()
    job = Job(kmend.pods, "ddp-first", "plain_ddp.py", steps=1000, world=2, fault=fault)
    try:
        incs = kmend.wait_for(lambda i: bool(of_class(i, "hang")), 100)
        found = time.time()
        logged = [p.text() for p in job.pods]
    finally:
        job.stop()
    hangs = of_class(incs, "hang")
    assert hangs, job.output()
    assert not any("step " in text for text in logged)  # no rank ever printed a step
    assert hangs[0]["root_cause"]["job"] == "ddp-first"
    print(f"hang before the first step line: incident {found - begun:.1f} s after the job was launched")
    # Looked at from half the first look's threshold on, every half threshold while start-up holds it.
    assert found - begun <= HangConfig().first_look_s + 30.0, found - begun
    assert of_class(incs, "straggler") == []
