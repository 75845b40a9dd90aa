"""Only log lines become rows: metric and progress samples are analysed (findings, detector state) and not
stored; a redelivered log line is still recognised."""

from __future__ import annotations

from pathlib import Path

from collector.signal import MetricSample, ProgressSample, Signal, Source
from healer.notify import LogNotifier
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import container

T0 = 1_700_000_000.0


def test_metric_and_progress_samples_are_analysed_but_not_stored(tmp_path: Path) -> None:
    k = make_kmend(Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim"),
                   cluster=build_cluster(2), notifier=LogNotifier())
    k.start()
    labels = {"gpu": "3", "pci": "00000000:3B:00.0", "err_code": "79"}
    xid = Signal("gpu-node-00/dcgm/1", "gpu-node-00", Source.DCGM, T0, MetricSample("DCGM_FI_DEV_XID_ERRORS", 79,
                                                                                     labels))
    steps = [Signal(f"gpu-node-00/progress/{i}", "gpu-node-00", Source.PROGRESS, T0 + i,
                    ProgressSample("llm", 0, i, 1.0)) for i in range(1, 6)]
    line = container("gpu-node-00", "step 5 loss 2.1", job="llm", rank=0, ts=T0)
    out = k.ingest([xid, *steps, line])
    assert out.accepted == 7 and out.duplicates == 0
    assert [f.fault_class.value for f in out.findings] == ["gpu_lost"]
    assert k.detectors.book.jobs["training/llm"].ranks[0].last_step == 5  # the bare reporter joins its namespaced job
    assert k.store.count_signals() == 1  # the log line only

    again = k.ingest([line])
    assert again.accepted == 0 and again.duplicates == 1
    k.store.close()
