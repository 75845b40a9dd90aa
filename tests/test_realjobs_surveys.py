"""Stragglers that the step lines cannot show, named from the agent's stack surveys, in real jobs (gloo, CPU, one pod
per rank as CRI files, `kmend agent` and `kmend serve` as processes, the agent's default settings): a plain DDP rank
slow before its all-reduce (every rank logs each step at the same moment) and a Hugging Face Trainer's slow rank 1
(only rank 0 prints progress at all)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.realjob import NODE, Job, Kmend, running_kmend

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.realjob, pytest.mark.timeout(150)]


@pytest.fixture
def kmend(tmp_path: Path) -> Iterator[Kmend]:
    with running_kmend(tmp_path) as k:
        yield k


def _named_from_stacks(incs: list[dict[str, Any]], rank: int, job: str) -> dict[str, str]:
    summary = [(i["fault_class"], i["root_cause"]) for i in incs]
    [inc] = [i for i in incs if i["fault_class"] == "straggler"]
    cause = inc["root_cause"]
    assert (cause["rank"], cause["node"], cause["job"]) == (rank, NODE, job), summary
    [f] = [f for f in inc["findings"] if f["fields"].get("basis") == "stacks"]
    assert not [i for i in incs if i["fault_class"] == "hang"], summary
    fields: dict[str, str] = f["fields"]
    return fields


def test_a_rank_slow_before_its_all_reduce_is_named_from_the_stack_surveys(kmend: Kmend) -> None:
    # Rank 2 sleeps before each forward pass: its peers wait for it in the gradient all-reduce, and every rank
    # logs each step at the same moment, so the step lines cannot tell it. The agent's stack surveys can.
    fault = {"KMEND_FAULT": "slow_forward", "KMEND_FAULT_RANK": "2", "KMEND_FAULT_AFTER": "5",
             "KMEND_FAULT_SLOW_S": "0.1"}
    job = Job(kmend.pods, "ddp-slowfwd", "plain_ddp.py", steps=100_000, world=4, fault=fault)
    try:
        incs = kmend.wait_for(lambda i: any(x["fault_class"] == "straggler" for x in i), 90)
    finally:
        job.stop()
    fields = _named_from_stacks(incs, 2, "ddp-slowfwd")
    assert float(fields["outside_share"]) > 2 * float(fields["peers_outside_share"]), fields


def test_a_hugging_face_trainers_slow_rank_1_is_named_though_only_rank_0_prints(kmend: Kmend) -> None:
    fault = {"KMEND_FAULT": "slow_forward", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "5",
             "KMEND_FAULT_SLOW_S": "0.1"}
    job = Job(kmend.pods, "gpt2-slow", "hf_trainer.py", steps=100_000, world=2, fault=fault)
    try:
        incs = kmend.wait_for(lambda i: any(x["fault_class"] == "straggler" for x in i), 90)
    finally:
        job.stop()
    fields = _named_from_stacks(incs, 1, "gpt2-slow")
    assert float(fields["peers_collective_share"]) >= 0.5, fields  # rank 0 waits for it
