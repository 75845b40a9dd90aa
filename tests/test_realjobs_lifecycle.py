"""Real plain DDP jobs (gloo, CPU, one pod per rank as CRI files, `kmend agent` and `kmend serve` as processes) at the
ends of their lives: a rank killed from outside (SIGKILL, as the host's OOM killer does) is the incident's root cause
with its peers' closed-connection failures folded in and no node taken out; a job run again under the same pod names
after it finished, which hangs before the step its first run reached, is a hang with the stuck rank named."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realjob import NODE, Job, Kmend, running_kmend

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.realjob, pytest.mark.timeout(150)]


@pytest.fixture
def kmend(tmp_path: Path) -> Iterator[Kmend]:
    with running_kmend(tmp_path) as k:
        yield k


def test_a_rank_killed_from_outside_is_the_root_cause_and_its_peers_failures_follow_it(kmend: Kmend) -> None:
    job = Job(kmend.pods, "ddp-killed", "plain_ddp.py", steps=100_000, world=3)
    try:
        deadline = time.monotonic() + 90
        while " stdout F step 20 " not in job.pods[1].text():
            assert time.monotonic() < deadline, job.output()
            time.sleep(0.2)
        [pid] = job.pods[1].worker_pids()
        os.kill(pid, signal.SIGKILL)
        # Every rank fails within seconds: the killed one's launcher reports the signal, the others' all-reduce
        # reads a closed connection.
        assert job.wait(60) == [1, 1, 1], job.output()
        incs = kmend.wait_for(lambda i: any(x["root_cause"]["rank"] == 1 for x in i), 30)
        time.sleep(2.0)  # past the symptom settle time: the peers' failures have been folded in or not
        incs = kmend.incidents()
    finally:
        job.stop()
    summary = [(i["fault_class"], i["root_cause"]["rank"], [f["rule_id"] for f in i["findings"]]) for i in incs]
    assert len(incs) == 1, summary  # one incident for the one fault
    [inc] = incs
    assert (inc["root_cause"]["rank"], inc["root_cause"]["node"], inc["root_cause"]["job"]) == (1, NODE, "ddp-killed")
    assert inc["fault_class"] == "oom_host" and not inc["hardware"], summary
    rules = {f["rule_id"] for f in inc["findings"]}
    assert "rank-sigkilled" in rules and "gloo-peer-closed" in rules, summary
    nodes = kmend.nodes()
    assert not [n for n, v in nodes.items() if v["cordoned"] or v["fault"]], nodes


def test_a_job_run_again_that_hangs_before_its_old_last_step_is_a_hang_with_the_rank_named(kmend: Kmend) -> None:
    first = Job(kmend.pods, "ddp-rerun", "plain_ddp.py", steps=60, world=3)
    try:
        assert first.wait(90) == [0, 0, 0], first.output()
    finally:
        first.stop()
    # The same job and pod names again (new pod directories beside the old ones, as a restarted job's pods):
    # rank 1 stops at step 20, before the 60 the first run reached.
    fault = {"KMEND_FAULT": "stop", "KMEND_FAULT_RANK": "1", "KMEND_FAULT_AFTER": "20"}
    again = Job(kmend.pods, "ddp-rerun", "plain_ddp.py", steps=100_000, world=3, fault=fault)
    try:
        incs = kmend.wait_for(lambda i: any(f["rule_id"] == "stack-dump" for x in i if x["fault_class"] == "hang"
                                            for f in x["findings"]), 90)
    finally:
        again.stop()
    summary = [(i["fault_class"], i["root_cause"]) for i in incs]
    [hang] = [i for i in incs if i["fault_class"] == "hang"]
    assert (hang["root_cause"]["job"], hang["root_cause"]["rank"]) == ("ddp-rerun", 1), summary
    [stacks] = [f for f in hang["findings"] if f["rule_id"] == "stack-dump"]
    assert stacks["fields"]["stopped_ranks"] == "1", stacks["fields"]

