"""The service around the hang detector: evidence asked for before the hang is called (a large job's requests in one
transaction), pods the API shows done."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event

from collector.signal import ProgressSample, Signal, Source
from healer.notify import LogNotifier
from healer.steps.base import RepairRequest
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.store import Store
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from sim.workloads import SimWorkloads

T0 = 1_800_000_000.0


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Kmend, SimWorkloads]]:
    cluster = build_cluster(2, 8)
    workloads = SimWorkloads(cluster, clock=lambda: T0)
    for r in range(4):
        workloads.add_pod("train", f"llm-{r}", node=f"node-{r // 2:03d}", gpus=0,
                          labels={"kmend.io/job": "llm", "kmend.io/rank": str(r)})
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", dry_run=True)
    kmend = make_kmend(settings, cluster=cluster, workloads=workloads, notifier=LogNotifier())
    kmend.start()
    yield kmend, workloads
    kmend.store.close()


def _steps(kmend: Kmend, n: int, step_s: float = 0.5) -> float:
    t = T0
    for s in range(1, n + 1):
        t += step_s
        kmend.ingest([Signal(f"node-{r // 2:03d}/progress/llm/{r}/{s}", f"node-{r // 2:03d}", Source.PROGRESS, t,
                             ProgressSample("llm", r, s, step_s)) for r in range(4)])
    return t


def _hangs(kmend: Kmend) -> list[str]:
    return [i.id for i in kmend.incidents() if i.fault_class.value == "hang"]


def test_a_stalled_job_gets_stack_requests_on_its_nodes_before_the_hang_is_called(
    service: tuple[Kmend, SimWorkloads],
) -> None:
    kmend, _ = service
    last = _steps(kmend, 30)
    kmend.evaluate(now=last + 7)  # past half the 13 s threshold
    asked = {n: [r.kind for r in kmend.healing.requests(n)] for n in ("node-000", "node-001")}
    assert asked == {"node-000": ["stack_dump"], "node-001": ["stack_dump"]}
    assert _hangs(kmend) == []
    [req] = kmend.healing.requests("node-001")
    assert req.params == {"job": "llm"}
    kmend.evaluate(now=last + 8)
    assert len(kmend.healing.requests("node-001")) == 1  # one request per node and stall
    kmend.evaluate(now=last + 14)
    assert len(_hangs(kmend)) == 1


def test_a_job_whose_pods_the_api_shows_deleted_raises_no_hang(service: tuple[Kmend, SimWorkloads]) -> None:
    kmend, workloads = service
    last = _steps(kmend, 30)
    for r in range(4):
        workloads.delete_pod("train", f"llm-{r}")
    for k in range(1, 60):
        kmend.evaluate(now=last + k)
    assert _hangs(kmend) == []
    assert kmend.healing.requests("node-000") == []  # nothing to capture from pods that are going away


def test_deleting_a_jobs_pods_in_its_namespace_ends_it_while_its_name_runs_on_elsewhere(
    service: tuple[Kmend, SimWorkloads],
) -> None:
    kmend, workloads = service
    for r in range(4):  # another team's job of the same name, still running
        workloads.add_pod("other", f"llm-{r}", node="node-001", gpus=0,
                          labels={"kmend.io/job": "llm", "kmend.io/rank": str(r)})
    t = T0
    for s in range(1, 31):
        t += 0.5
        kmend.ingest([Signal(f"node-{r // 2:03d}/progress/llm/{r}/{s}", f"node-{r // 2:03d}", Source.PROGRESS, t,
                             ProgressSample("llm", r, s, 0.5, namespace="train")) for r in range(4)])
    for r in range(4):
        workloads.delete_pod("train", f"llm-{r}")
    for k in range(1, 60):
        kmend.evaluate(now=t + k)
    assert _hangs(kmend) == []


LOADER = ('Thread 9 (idle): "MainThread"\n    get (queue.py:180)\n'
          "    _get_data (torch/utils/data/dataloader.py:1294)\n    _next_data (torch/utils/data/dataloader.py:1332)\n"
          "    train (train.py:40)\n")
ALL_REDUCE = ('Thread 9 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n'
              "    train (train.py:46)\n")
SLEEP = 'Thread 9 (idle): "MainThread"\n    sleep_forever (train.py:59)\n    train (train.py:44)\n'


def test_stacks_of_a_busy_data_loader_hold_the_hang_and_newer_stacks_are_asked_for(
    service: tuple[Kmend, SimWorkloads],
) -> None:
    kmend, _ = service
    last = _steps(kmend, 30)
    wall = [last]
    kmend.clock = lambda: wall[0]
    kmend.detector_now()  # the service's clock reads the last step's time, then moves on
    kmend.evaluate(now=last + 7)
    wall[0] = last + 9  # the agent answers 2 s after the request
    for r in range(4):  # rank 2 waits on its data loader's workers, the others for it in the all-reduce
        kmend.ingest_stack("llm", r, f"node-{r // 2:03d}", 100 + r, LOADER if r == 2 else ALL_REDUCE, "S")
    kmend.evaluate(now=last + 14)
    assert _hangs(kmend) == []  # past the 13 s threshold: held
    again = [r.id for r in kmend.healing.requests("node-001")]
    assert len(again) == 2 and again[1].endswith(":2")  # a newer look at the held job
    wall[0] = last + 15.5
    for r in range(4):  # rank 2 now in its own code: moved since the last look, so the job still runs
        kmend.ingest_stack("llm", r, f"node-{r // 2:03d}", 100 + r, SLEEP if r == 2 else ALL_REDUCE, "S")
    kmend.evaluate(now=last + 16)
    assert _hangs(kmend) == []
    kmend.evaluate(now=last + 20)  # half a threshold later: another look
    assert [r.id for r in kmend.healing.requests("node-001")][-1].endswith(":3")
    wall[0] = last + 21.5
    for r in range(4):  # the same stacks again: stuck
        kmend.ingest_stack("llm", r, f"node-{r // 2:03d}", 100 + r, SLEEP if r == 2 else ALL_REDUCE, "S")
    kmend.evaluate(now=last + 22)
    [hang] = [i for i in kmend.incidents() if i.fault_class.value == "hang"]
    assert hang.root_cause.rank == 2


def test_the_hold_bound_is_a_setting(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", dry_run=True, hang_hold_k=1.0)
    kmend = make_kmend(settings, cluster=build_cluster(2, 8), notifier=LogNotifier())
    assert kmend.detectors.hang.config.hold_k == 1.0
    kmend.store.close()
    with pytest.raises(ValueError, match="hang_hold_k"):
        Settings(database_url="sqlite://", cluster="sim", hang_hold_k=0.5)


def test_a_stalled_jobs_stack_requests_on_many_nodes_take_the_write_queue_once(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", dry_run=True)
    kmend = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    kmend.start()
    nodes = [f"node-{r:04d}" for r in range(512)]  # one rank per node
    t = T0
    for s in range(1, 31):
        t += 0.5
        kmend.ingest([Signal(f"{n}/progress/big/{r}/{s}", n, Source.PROGRESS, t, ProgressSample("big", r, s, 0.5))
                      for r, n in enumerate(nodes)])
    transactions: list[object] = []

    def began(conn: object) -> None:
        transactions.append(conn)

    event.listen(kmend.store.engine, "begin", began)
    kmend.evaluate(now=t + 7)  # past half the hang threshold: every node's agent is asked for stacks
    event.remove(kmend.store.engine, "begin", began)
    assert all(len(kmend.healing.requests(n)) == 1 for n in nodes)
    # Not one transaction (each a turn of the write queue that group commits wait behind) per node.
    assert len(transactions) < 10, f"{len(transactions)} transactions for one evaluation"
    kmend.store.close()


def test_requests_opened_together_leave_those_already_there_as_they_are(database_url: str) -> None:
    store = Store(database_url)
    store.migrate()
    store.ledger.open(RepairRequest("a", "node-000", "stack_dump", {"job": "llm"}))
    store.ledger.answer("a", "done", "stacks sent")
    store.ledger.open_all([RepairRequest("a", "node-000", "stack_dump", {"job": "llm"}),
                           RepairRequest("b", "node-001", "stack_dump", {"job": "llm"})])
    [a] = store.ledger.requests_for("node-000", pending_only=False)
    assert (a.state, a.result) == ("done", "stacks sent")
    [b] = store.ledger.requests_for("node-001")
    assert (b.kind, b.params, b.state) == ("stack_dump", {"job": "llm"}, "pending")
    store.ledger.open_all([])
    store.close()
