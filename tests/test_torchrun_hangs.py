"""Real torchrun DDP jobs (gloo, 4 CPU ranks) against the running service with default hang settings: an
all-stalled hang is named from py-spy stacks and gloo's timeout lines (a job that finishes through the hook:
tests/test_realjobs_hook.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.stacks import ProcessFinder, PySpyDumper, StackRequestResponder, TrainingProcess
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.commands.agent import _py_spy
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.test_torchrun import NODES, _incidents, _launch, _ship, node_of

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Kmend, httpx.Client, str]]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", sim_nodes=2,
                        healer_interval_s=0.1, detector_interval_s=0.5, dry_run=True)
    kmend = make_kmend(settings, cluster=build_cluster(2, 8), notifier=LogNotifier())
    with serve_in_thread(create_app(kmend, settings)) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield kmend, client, url
    kmend.store.close()


class NodeFinder(ProcessFinder):
    """Both "nodes" are this machine: each node's agent sees only the ranks placed on it."""

    def __init__(self, node: str) -> None:
        super().__init__(pods_root=None)
        self.node = node

    def find(self) -> list[TrainingProcess]:
        return [p for p in super().find() if node_of(p.rank) == self.node]


def test_an_all_stalled_ddp_hang_is_named_by_py_spy_stacks_then_by_the_ranks_gloo_left_waiting(
    tmp_path: Path, service: tuple[Kmend, httpx.Client, str],
) -> None:
    py_spy = _py_spy("py-spy")
    if py_spy is None or os.geteuid() != 0:
        pytest.skip("py-spy needs to be installed and to run as root (ptrace) here")
    _, client, url = service
    # Rank 2 logs step 15 like the others, then blocks before the all-reduce they are already in.
    proc, agent = _launch(tmp_path, "tiny-ddp", 1000, {"KMEND_TEST_HANG_RANK": "2", "KMEND_TEST_HANG_STEP": "15",
                                                       "KMEND_TEST_HANG_WHERE": "collective",
                                                       "KMEND_TEST_GLOO_TIMEOUT_S": "25"})
    responders = [StackRequestResponder(url=url, node=n, finder=NodeFinder(n), dumper=PySpyDumper(py_spy),
                                        clock=time.monotonic, interval_s=0.5) for n in NODES]
    hang: dict[str, Any] | None = None
    named_after = detected_after = None
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            _ship(client, agent.poll())
            for r in responders:
                r.poll()
            found = [i for i in _incidents(client) if i["fault_class"] == "hang"]
            if found and detected_after is None:
                detected_after = time.time() - agent.step_lines_at
            if found and found[0]["root_cause"]["rank"] is not None and named_after is None:
                hang, named_after = found[0], time.time() - agent.step_lines_at
            time.sleep(0.2)
        proc.wait(timeout=60)
        _ship(client, agent.poll())
        time.sleep(5)  # the complaints settle
    finally:
        for r in responders:
            r.close()
    assert hang is not None and named_after is not None, (tmp_path / "torchrun.out").read_text()[-3000:]
    # Every rank logged step 15: progress alone cannot tell who stopped.
    assert {line.split()[1] for line in (tmp_path / "logs" / "rank0.log").read_text().splitlines()
            if line.startswith("step ")} >= {"15"}
    print(f"hang detected {detected_after:.1f} s, rank named {named_after:.1f} s after the last step line")
    assert named_after <= 15.0, named_after
    [inc] = [i for i in _incidents(client) if i["id"] == hang["id"]]
    assert (inc["root_cause"]["rank"], inc["root_cause"]["node"]) == (2, "gpu-node-01")
    rules = {f["rule_id"]: f for f in inc["findings"]}
    stack = rules["stack-dump"]
    assert stack["fields"]["waiting_in_collective"] == "0,1,3" and stack["fields"]["culprit_rank"] == "2"
    assert "tiny_ddp.py" in stack["fields"]["culprit_stack"]  # where the operator sees rank 2 is stuck
    assert "all_reduce" in stack["fields"]["innermost_frames"]
    # Then gloo gave up on the waiting ranks. When all three printed their timeout before torchrun stopped
    # the others, the one that never complained is named; when one was stopped first, two ranks are
    # silent and the lines name nobody, never a wrong rank.
    complained = sorted(f["where"]["rank"] for f in inc["findings"] if f["rule_id"] == "gloo-collective-timeout")
    assert len(complained) >= 2 and 2 not in complained, complained
    if complained == [0, 1, 3]:
        witness = rules["timeout-witnesses"]
        assert witness["where"]["rank"] == 2 and witness["fields"]["complained_ranks"] == "0,1,3"
    else:
        assert "timeout-witnesses" not in rules
    assert inc["root_cause"]["rank"] == 2
    answered = client.get("/v1/nodes/gpu-node-01/requests", params={"all": True}).json()["requests"]
    # A first look at half the threshold and at most a second before it (a running job's stacks would have
    # moved): each answered once, none repeated while the hang stood.
    assert [r["state"] for r in answered if r["kind"] == "stack_dump"] in (["done"], ["done", "done"]), answered
