"""Two replicas on one real PostgreSQL: each ingests, the Lease holder alone correlates the feed and heals;
a takeover goes on from the stored cursor without a second plan; a numbered batch replayed to the other replica
is recognised; a feed row committed late (lower identity number) is not skipped."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import select

from analyzer.records import FaultClass
from collector.signal import Signal
from healer.notify import LogNotifier
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.store import schema
from kmend.store.feed import _TX, digest_to_dict
from kmend.wiring import make_kmend
from sim.cluster import SimCluster, build_cluster
from tests.builders import XID79, container, kernel, nccl_timeout

pytestmark = pytest.mark.postgres

NODES = ["gpu-node-00", "gpu-node-01", "gpu-node-02", "gpu-node-03"]


class Lease:
    """Who holds the Lease (the real elector is covered by test_lease and the process test)."""

    def __init__(self, holder: str) -> None:
        self.holder = holder

    def seat(self, name: str) -> Seat:
        return Seat(self, name)


class Seat:
    def __init__(self, lease: Lease, name: str) -> None:
        self.lease, self.name = lease, name

    def is_leader(self) -> bool:
        return self.lease.holder == self.name

    def tick(self) -> bool:
        return self.is_leader()


@contextmanager
def two_replicas(url: str) -> Iterator[tuple[Kmend, Kmend, Lease, SimCluster]]:
    """Replicas "a" (which holds the Lease) and "b" on the database at `url`, over one simulated cluster."""
    cluster: SimCluster = build_cluster(8, spares=2)
    lease = Lease("a")
    made = []
    for name in ("a", "b"):
        settings = Settings(database_url=url, cluster="sim", replicated=True, symptom_settle_s=0,
                            identity=name)
        k = make_kmend(settings, cluster=cluster, notifier=LogNotifier(), leader=lease.seat(name))
        k.start()
        made.append(k)
    try:
        yield made[0], made[1], lease, cluster
    finally:
        for k in made:
            assert k.replicas is not None
            k.replicas.close()
            k.store.close()


@pytest.fixture
def pair(fresh_postgres_url: str) -> Iterator[tuple[Kmend, Kmend, Lease]]:
    with two_replicas(fresh_postgres_url) as (a, b, lease, _):
        yield a, b, lease


def _symptoms(ts: float) -> list[Signal]:
    """Every rank of job-a times out in its collective (a rank per node): the symptom of a lost GPU."""
    return [container(node, nccl_timeout(r), rank=r, ts=ts) for r, node in enumerate(NODES)]


def _active(k: Kmend) -> list[dict[str, object]]:
    return [i for i in k.store.list_incidents() if i["state"] in ("open", "remediating")]


def test_signals_split_over_two_replicas_make_one_incident_and_one_plan(pair: tuple[Kmend, Kmend, Lease]) -> None:
    a, b, lease = pair
    t = 1_700_000_000.0
    # The job's symptom lines reach replica b, the node's Xid 79 replica a: neither alone sees the cause
    # behind the symptoms.
    b.ingest(_symptoms(t + 2))
    out = a.ingest([kernel("gpu-node-01", XID79, ts=t)])
    assert [f.fault_class for f in out.findings] == [FaultClass.GPU_LOST] and out.incidents == ()
    assert b.replicas is not None and a.replicas is not None
    assert b.replicas.tail() == 0 and not b.replicas.leading  # not holding the Lease: it folds nothing
    assert a.replicas.tail() == 2
    [inc] = _active(a)
    assert inc["root_cause"]["node"] == "gpu-node-01"  # type: ignore[index]
    assert inc["fault_class"] == FaultClass.GPU_LOST.value
    members = a.store.get_incident(str(inc["id"]))
    assert members is not None and len(members["findings"]) == 5  # the Xid and the four ranks' timeouts
    counted = [s.value for k in (a, b) for m in k.metrics.registry.collect()
               if m.name == "kmend_analyzer_findings" for s in m.samples if s.name.endswith("_total")]
    assert sum(counted) == 5  # each finding counted once, by the replica that matched it
    a.heal_once()
    b.heal_once()
    plans = a.store.list_plans()
    assert [p.incident_id for p in plans] == [inc["id"]]

    # The Lease passes to b: it puts back the stored incident, reads on from the stored cursor, and makes no
    # second plan for it; a later finding on the same node joins the same incident.
    lease.holder = "b"
    a.ingest([container("gpu-node-02", nccl_timeout(2, seq=1581), rank=2, ts=t + 5)])
    assert a.replicas.tail() == 0 and not a.replicas.leading
    assert b.replicas.tail() == 1 and b.replicas.leading
    for _ in range(3):
        b.heal_once()
    assert [p.incident_id for p in b.store.list_plans()] == [inc["id"]]
    [after] = _active(b)
    assert after["id"] == inc["id"] and after["finding_count"] == 6


def test_a_numbered_batch_replayed_to_the_other_replica_is_recognised(pair: tuple[Kmend, Kmend, Lease]) -> None:
    a, b, _ = pair
    batch = [kernel("gpu-node-01", XID79)]
    first = a.ingest(batch, ("gpu-node-01/p1", 7))
    assert first.accepted == 1 and len(first.findings) == 1
    again = b.ingest(batch, ("gpu-node-01/p1", 7))
    assert (again.accepted, again.duplicates, again.findings) == (0, 1, ())
    assert a.replicas is not None and a.replicas.tail() == 1  # one feed row: the Xid is folded once
    [inc] = _active(a)
    members = a.store.get_incident(str(inc["id"]))
    assert members is not None and len(members["findings"]) == 1


def test_the_same_numbered_batch_at_two_replicas_at_once_is_taken_once(pair: tuple[Kmend, Kmend, Lease]) -> None:
    a, b, _ = pair
    outcomes = []
    for seq in range(1, 21):
        batch = [kernel("gpu-node-02", f"kernel line {seq}", ts=1_700_000_000.0 + seq)]
        go = threading.Barrier(2)

        def send(k: Kmend, batch: list[Signal] = batch, seq: int = seq, go: threading.Barrier = go) -> None:
            go.wait()
            outcomes.append(k.ingest(batch, ("gpu-node-02/p9", seq)).accepted)

        threads = [threading.Thread(target=send, args=(k,)) for k in (a, b)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert sorted(outcomes) == [0] * 20 + [1] * 20


def test_a_feed_row_committed_late_is_folded_not_skipped(pair: tuple[Kmend, Kmend, Lease]) -> None:
    a, b, _ = pair
    assert a.replicas is not None
    t = 1_700_000_000.0
    # A replica's transaction takes its feed number first and commits last.
    slow = b.analyzer.digest([kernel("gpu-node-03", XID79, ts=t)])
    conn = b.store.engine.connect()
    tx = conn.begin()
    conn.execute(schema.replica_feed.insert().values(tx=_TX, at=t, body=digest_to_dict(slow)))
    b.ingest([kernel("gpu-node-05", XID79, ts=t + 1)])  # a later number, committed first
    with a.store.engine.connect() as c:
        assert len(c.execute(select(schema.replica_feed.c.seq)).all()) == 1  # the slow row is not visible yet
    assert a.replicas.tail() == 0  # the committed row waits behind the older transaction still running
    tx.commit()
    conn.close()
    assert a.replicas.tail() == 2
    assert sorted(str(i["root_cause"]["node"]) for i in _active(a)) == [  # type: ignore[index]
        "gpu-node-03", "gpu-node-05"]


@pytest.mark.timeout(120)
def test_replicas_starting_together_migrate_the_schema_once(fresh_postgres_url: str) -> None:
    from kmend.store import Store

    stores = [Store(fresh_postgres_url) for _ in range(4)]
    go = threading.Barrier(len(stores))
    errors: list[BaseException] = []

    def start(store: Store) -> None:
        go.wait()
        try:
            store.migrate()
        except BaseException as exc:  # collected: the assertion below names it
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in stores]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert {s.revision() for s in stores} == {"0008"}
    for s in stores:
        s.close()


def test_a_stack_dump_posted_to_a_replica_reaches_the_leaders_stack_detector(pair: tuple[Kmend, Kmend, Lease]) -> None:
    a, b, _ = pair
    assert a.replicas is not None
    b.ingest_stack("job-a", 1, "gpu-node-01", 4242, "Thread 4242 (idle): \"MainThread\"\n    wait (torch/x.py:1)",
                   state="T", cpu_s=12.5)
    assert a.replicas.tail() == 1
    kept = a.detectors.stacks._stacks["job-a"][1]
    assert (kept.node, kept.pid, kept.stopped, kept.cpu_s) == ("gpu-node-01", 4242, True, 12.5)
    assert "job-a" not in b.detectors.stacks._stacks  # the replica that received it keeps nothing


def test_progress_split_over_replicas_reaches_one_hang_detector(pair: tuple[Kmend, Kmend, Lease]) -> None:
    from collector.signal import ProgressSample, Source

    a, b, _ = pair
    assert a.replicas is not None and b.replicas is not None
    t = 1_700_000_000.0
    # Four ranks on four nodes; ranks 0 and 1 report to replica a, ranks 2 and 3 to replica b. All stop at step 30.
    for step in range(1, 31):
        for k, ranks in ((a, (0, 1)), (b, (2, 3))):
            k.ingest([Signal(f"{NODES[r]}/progress/{r}/{step}", NODES[r], Source.PROGRESS, t + step,
                             ProgressSample("job-h", r, step, step_time=1.0)) for r in ranks])
    assert b.replicas.tail() == 0
    assert a.replicas.tail() == 60
    assert sorted(a.detectors.book.jobs["job-h"].ranks) == [0, 1, 2, 3]
    assert "job-h" not in b.detectors.book.jobs
    assert b.evaluate(now=t + 120).findings == ()  # detectors run on the leader only
    hang = [f for f in a.evaluate(now=t + 120).findings if f.fault_class is FaultClass.HANG]
    assert [f.where.job for f in hang] == ["job-h"]


def test_flight_recorder_dumps_posted_to_both_replicas_are_judged_together(pair: tuple[Kmend, Kmend, Lease]) -> None:
    from tests.test_agent_flight_recorder import GLOO

    a, b, _ = pair
    assert a.replicas is not None
    for k, r in ((a, 0), (b, 2)):  # ranks 0 and 2 of a 3-rank gloo job wrote dumps; rank 1 never joined
        k.ingest_flight_recorder("gloo-job", r, "gpu-node-01", (GLOO / f"gloo_trace_rank_{r}").read_bytes())
    assert a.replicas.tail() == 2
    now = a.clock() + 60
    assert b.evaluate(now=now).findings == ()
    [f] = [x for x in a.evaluate(now=now).findings if x.rule_id == "flight-recorder"]
    assert (f.where.job, f.where.rank) == ("gloo-job", 1)


def test_a_replica_that_does_not_lead_shows_the_leaders_current_view(pair: tuple[Kmend, Kmend, Lease]) -> None:
    from analyzer.records import IncidentState

    a, b, _ = pair
    assert a.replicas is not None and b.replicas is not None
    assert b.node_health()["gpu-node-01"]["state"] == "healthy"
    # b started before the fault and never folds the feed; a client behind the Service may still ask b.
    b.ingest([kernel("gpu-node-01", XID79)])
    assert a.replicas.tail() == 1
    [inc] = _active(a)
    assert b.node_health()["gpu-node-01"]["state"] == "suspect"
    assert b.node_health()["gpu-node-01"]["incidents"] == [inc["id"]]
    assert [i.id for i in b.incidents()] == [inc["id"]]
    # Its gauges, which Prometheus scrapes from every replica, count the leader's incidents too.
    b.refresh_gauges()
    assert _open_gauge(b, "gpu_lost") == 1.0
    # The leader resolves it: b shows that too, at once.
    a.set_incident_state(str(inc["id"]), IncidentState.RESOLVED, "checked")
    assert b.node_health()["gpu-node-01"]["state"] == "healthy"
    assert [i.state for i in b.incidents()] == [IncidentState.RESOLVED]
    b.refresh_gauges()
    assert _open_gauge(b, "gpu_lost") == 0.0


def _open_gauge(k: Kmend, fault_class: str) -> float:
    return k.metrics.registry.get_sample_value("kmend_incidents_open", {"fault_class": fault_class}) or 0.0


def _dcgm(node: str, name: str, value: float, ts: float, labels: dict[str, str]) -> Signal:
    from collector.signal import MetricSample, Source

    return Signal(f"{node}/dcgm/{name}/{ts}", node, Source.DCGM, ts, MetricSample(name, value, labels))


GPU3 = {"gpu": "3", "UUID": "GPU-3f809e614-a528-4083-acbf-334600000000", "pci_bus_id": "00000000:5D:00.0"}


def test_metric_windows_split_over_replicas_are_judged_once(pair: tuple[Kmend, Kmend, Lease]) -> None:
    a, b, _ = pair
    t = 1_700_000_000.0
    node = "gpu-node-02"
    # One node's batches alternate between the replicas (a Service without affinity), numbered by its agent.
    # Each batch carries one sample of a counter (its first sample is only a baseline) and one of the clock
    # throttle reasons (thermal slowdown, a finding after 4 samples in a row).
    remapped = [0, 1, 1, 1, 1, 1]
    throttle = [64, 64, 64, 64, 64, 64]
    found: list[tuple[int, str]] = []
    for i, (rows, bits) in enumerate(zip(remapped, throttle, strict=True)):
        k = (a, b)[i % 2]
        batch = [_dcgm(node, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", rows, t + 30 * i, GPU3),
                 _dcgm(node, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", bits, t + 30 * i, GPU3)]
        found += [(i, f.rule_id) for f in k.ingest(batch, (f"{node}/agent", i + 1)).findings]
    # The increase reached b after a saw the baseline; the fourth hot sample was b's second.
    assert found == [(1, "gpu-uncorrectable-remapped-rows"), (3, "gpu-thermal-slowdown")]
    assert a.replicas is not None and a.replicas.tail() == 6  # a feed row per batch (GPU metrics for the detectors)
    stored = [f.rule_id for f in a.store.findings_in_order()]
    assert sorted(stored) == ["gpu-thermal-slowdown", "gpu-uncorrectable-remapped-rows"]
