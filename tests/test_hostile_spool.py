"""Spool under pressure: the least valuable goes first, every drop is counted, and lines that cannot be
kept stay in their files (read positions do not advance) until the service is back."""

from __future__ import annotations

import time
from pathlib import Path

from collector.agent import Agent
from collector.checkpoint import CheckpointStore
from collector.metrics import AgentMetrics
from collector.shipper import Shipper
from collector.signal import LogLine, MetricSample, Signal, Source
from collector.sources.cri import CriLogSource
from collector.spool import DiskSpool, Value
from kmend.commands.agent import AgentSettings, build_value_of
from tests.agent_helpers import TOKEN, CriWriter, Service
from tests.conftest import free_port

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
NCCL = ("[rank3]:[E1121 10:00:01.123456 ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
        "600061 milliseconds before timing out.")


def _value(metrics: AgentMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_values_come_from_the_rule_packs() -> None:
    value_of = build_value_of(AgentSettings(node="gpu-node-01"))

    def line(text: str) -> Signal:
        return Signal("n/1", "gpu-node-01", Source.CONTAINER, 1.0, LogLine(text))

    assert value_of(line(XID)) is Value.CAUSE
    assert value_of(line(NCCL)) is Value.SYMPTOM
    assert value_of(line("iteration 100/1000 | consumed samples: 800 | elapsed time per iteration (ms): 512.3")) \
        is Value.TELEMETRY
    assert value_of(Signal("n/2", "gpu-node-01", Source.DCGM, 1.0, MetricSample("DCGM_FI_DEV_GPU_TEMP", 60.0))) \
        is Value.TELEMETRY


def test_a_long_outage_drops_telemetry_then_symptoms_and_keeps_the_first_cause(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path / "spool", max_bytes=1000)
    assert spool.put(b"X" * 200, 1, Value.CAUSE)  # the Xid line comes first
    for _ in range(3):
        assert spool.put(b"m" * 200, 50, Value.TELEMETRY)
    assert spool.put(b"s" * 200, 100, Value.SYMPTOM)
    # The flood of symptoms: telemetry makes room first, then equal-value symptoms are refused.
    assert spool.put(b"s" * 200, 100, Value.SYMPTOM)
    assert spool.put(b"s" * 200, 100, Value.SYMPTOM)
    assert spool.dropped_by_value[Value.TELEMETRY] == 100
    assert spool.put(b"s" * 200, 100, Value.SYMPTOM)  # the last telemetry goes
    assert not spool.put(b"s" * 200, 100, Value.SYMPTOM)  # no symptom is dropped for another one
    # A second cause pushes out a symptom, never the first cause.
    assert spool.put(b"Y" * 200, 1, Value.CAUSE)
    held = []
    while (b := spool.peek()) is not None:
        held.append((b.value, spool.read(b)[:1]))
        spool.pop(b)
    assert held[0] == (Value.CAUSE, b"X") and (Value.CAUSE, b"Y") in held
    assert spool.dropped_by_value == {Value.TELEMETRY: 150, Value.SYMPTOM: 100}


def test_full_spool_holds_the_lines_in_their_files_until_the_service_returns(tmp_path: Path) -> None:
    svc = Service(tmp_path, free_port())  # not started yet: the service is away
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "spool", max_bytes=600)
    shipper = Shipper(url=svc.url, token=TOKEN, spool=spool, metrics=metrics, timeout=1.0, max_backoff=0.0)
    pods = tmp_path / "pods"
    w = CriWriter(pods)
    cp_path = tmp_path / "cp.json"
    agent = Agent(sources=[CriLogSource(node="n1", root=pods, max_bytes_per_file=8192)], shipper=shipper,
                  checkpoints=CheckpointStore(cp_path), metrics=metrics, batch_size=50, flush_interval=0.0,
                  max_pending=200)
    for i in range(400):
        w.line(f"{NCCL} #{i}")
    for _ in range(30):
        agent.run_once()
    assert _value(metrics, "kmend_agent_backpressure_total") > 0
    assert _value(metrics, "kmend_agent_signals_dropped_total", reason="spool_full_symptom") == 0
    saved = CheckpointStore(cp_path).section("container")
    assert all(c["offset"] < w.live.stat().st_size for c in saved.values())  # never past lines not kept
    # The agent restarts; the service is back: unsaved lines are read again from the files.
    svc.start()
    try:
        agent2 = Agent(sources=[CriLogSource(node="n1", root=pods)], shipper=shipper,
                       checkpoints=CheckpointStore(cp_path), metrics=metrics, batch_size=50,
                       flush_interval=0.0, max_pending=200)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(svc.stored_ids()) < 400:
            agent2.run_once()
        assert len(svc.stored_ids()) == 400  # every line, once
    finally:
        svc.stop()
        svc.kmend.store.close()
