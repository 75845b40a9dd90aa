"""A rank of an unmodified plain DDP job killed from outside (SIGKILL, as the host's OOM killer does): the killed
rank is the incident's root cause, its peers' gloo "connection reset" failures are symptoms of it, and no node is
taken out of service for it."""

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
