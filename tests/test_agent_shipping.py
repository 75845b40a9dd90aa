"""Agent delivery: gzip + bearer token to the real service, disk spool and replay, checkpoints, /metrics."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collector.agent import Agent
from collector.checkpoint import CheckpointStore
from collector.httpserver import start_status_server
from collector.metrics import AgentMetrics
from collector.shipper import Shipper
from collector.signal import LogLine, Signal, Source
from collector.sources.base import Poll
from collector.sources.cri import CriLogSource
from collector.spool import DiskSpool, Value
from tests.agent_helpers import TOKEN, CriWriter, Service
from tests.conftest import free_port


def sig(i: int, text: str = "hello") -> Signal:
    return Signal(f"n1/container/fp/{i}", "n1", Source.CONTAINER, 1_700_000_000.0 + i, LogLine(text))


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, free_port())
    svc.start()
    yield svc
    with contextlib.suppress(AssertionError):
        svc.stop()
    svc.kmend.store.close()


def _shipper(url: str, spool: DiskSpool, metrics: AgentMetrics, token: str | None = TOKEN) -> Shipper:
    return Shipper(url=url, token=token, spool=spool, metrics=metrics, timeout=2.0, max_backoff=0.0)


def _value(metrics: AgentMetrics, name: str, **labels: str) -> float:
    v = metrics.registry.get_sample_value(name, labels or None)
    return v or 0.0


def test_spool_is_bounded_keeps_what_it_holds_and_survives_restart(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path / "spool", max_bytes=250)
    kept = [spool.put(bytes([i]) * 100, count=10) for i in range(5)]
    # Lines worth as much as those held are refused, never stored by dropping the older ones.
    assert kept == [True, True, False, False, False] and len(spool) == 2 and spool.dropped_signals == 0
    reopened = DiskSpool(tmp_path / "spool", max_bytes=250)
    first = reopened.peek()
    assert first is not None and reopened.read(first) == bytes([0]) * 100 and reopened.signals == 20
    reopened.pop(first)
    reopened.put(b"x", 1)
    order = []
    while (b := reopened.peek()) is not None:
        order.append(reopened.read(b)[:1])
        reopened.pop(b)
    assert order == [bytes([1]), b"x"]


def test_shipper_posts_gzip_with_token_to_real_service(tmp_path: Path, service: Service) -> None:
    metrics = AgentMetrics()
    sh = _shipper(service.url, DiskSpool(tmp_path / "spool"), metrics)
    sh.deliver([sig(1), sig(2)])
    sh.deliver([sig(2), sig(3)])  # redelivery is harmless: the service drops repeated ids
    assert service.stored_ids() == ["n1/container/fp/1", "n1/container/fp/2", "n1/container/fp/3"]
    assert _value(metrics, "kmend_agent_signals_shipped_total") == 4


def test_wrong_token_spools_instead_of_losing(tmp_path: Path, service: Service) -> None:
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "spool")
    _shipper(service.url, spool, metrics, token="wrong").deliver([sig(1)])
    assert service.stored_ids() == [] and spool.signals == 1
    # Token fixed: the spooled batch goes through.
    _shipper(service.url, spool, metrics).replay()
    assert service.stored_ids() == ["n1/container/fp/1"]


def test_outage_spools_then_replays_in_order(tmp_path: Path) -> None:
    svc = Service(tmp_path, free_port())
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "spool")
    sh = _shipper(svc.url, spool, metrics)
    sh.deliver([sig(1)])
    sh.deliver([sig(2)])
    assert len(spool) == 2 and _value(metrics, "kmend_agent_signals_spooled_total") == 2
    svc.start()
    try:
        sh.deliver([sig(3)])
        assert svc.stored_ids() == ["n1/container/fp/1", "n1/container/fp/2", "n1/container/fp/3"]
        assert len(spool) == 0 and _value(metrics, "kmend_agent_spool_bytes") == 0
    finally:
        svc.stop()
        svc.kmend.store.close()


def test_malformed_batch_is_dropped_and_counted_not_retried_forever(tmp_path: Path, service: Service) -> None:
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "spool")
    sh = _shipper(service.url, spool, metrics)
    sh.deliver([sig(1, text="x" * 70000)])  # longer than the wire format allows
    assert len(spool) == 0
    assert _value(metrics, "kmend_agent_signals_dropped_total", reason="rejected") == 1


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def poll(self) -> Poll:
        self.calls += 1
        raise OSError("device gone")

    def close(self) -> None:
        pass


def test_one_failing_source_never_stops_the_others(tmp_path: Path, service: Service) -> None:
    w = CriWriter(tmp_path / "pods")
    w.line("alive")
    metrics = AgentMetrics()
    broken = _Broken()
    agent = Agent(sources=[broken, CriLogSource(node="n1", root=tmp_path / "pods")],
                  shipper=_shipper(service.url, DiskSpool(tmp_path / "spool"), metrics),
                  checkpoints=CheckpointStore(tmp_path / "cp.json"), metrics=metrics, flush_interval=0)
    agent.run_once()
    agent.run_once()
    assert broken.calls == 2
    assert _value(metrics, "kmend_agent_source_errors_total", source="broken") == 2
    assert len(service.stored_ids()) == 1


class _FailingSpool(DiskSpool):
    def put(self, body: bytes, count: int, value: Value = Value.SYMPTOM) -> bool:
        raise OSError(28, "No space left on device")


def test_checkpoint_advances_only_after_ship_or_spool(tmp_path: Path) -> None:
    pods = tmp_path / "pods"
    w = CriWriter(pods)
    w.line("line 1")
    cp_path = tmp_path / "cp.json"
    metrics = AgentMetrics()
    dead = f"http://127.0.0.1:{free_port()}"
    agent = Agent(sources=[CriLogSource(node="n1", root=pods)],
                  shipper=_shipper(dead, _FailingSpool(tmp_path / "spool"), metrics),
                  checkpoints=CheckpointStore(cp_path), metrics=metrics, flush_interval=0)
    with pytest.raises(OSError):
        agent.run_once()
    assert not cp_path.exists()  # neither shipped nor spooled: nothing checkpointed
    agent2 = Agent(sources=[CriLogSource(node="n1", root=pods)],
                   shipper=_shipper(dead, DiskSpool(tmp_path / "spool"), metrics),
                   checkpoints=CheckpointStore(cp_path), metrics=metrics, flush_interval=0)
    agent2.run_once()
    saved = CheckpointStore(cp_path).section("container")
    assert list(saved.values()) == [{"offset": cp_path.parent.joinpath(
        "pods", "train_llama-worker-0_0000-1111", "trainer", "0.log").stat().st_size, "complete": False}]


def test_checkpoint_file_is_replaced_atomically_and_corruption_is_survived(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    store = CheckpointStore(path)
    store.update("container", {"abc": {"offset": 10}})
    store.save()
    assert not (tmp_path / "cp.json.tmp").exists()
    store.update("container", {"abc": None})
    store.save()
    assert CheckpointStore(path).section("container") == {}
    path.write_text('{"container": {"abc"')
    fresh = CheckpointStore(path)
    assert fresh.recovered and fresh.section("container") == {}


def test_status_server_serves_metrics_and_health(tmp_path: Path) -> None:
    metrics = AgentMetrics()
    metrics.lines_read.labels("container").inc(5)
    healthy = {"ok": True}
    port = free_port()
    server = start_status_server(metrics.registry, lambda: healthy["ok"], host="127.0.0.1", port=port)
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(body)}
        assert fams["kmend_agent_lines_read"].samples[0].value == 5
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        healthy["ok"] = False
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 503
    finally:
        server.shutdown()


def test_outage_and_recovery_are_logged_once_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    up = {"now": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["now"]:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"accepted": 1})

    spool = DiskSpool(tmp_path / "spool")
    shipper = Shipper(url="http://kmend.invalid", spool=spool, metrics=AgentMetrics(), max_backoff=0.0,
                      client=httpx.Client(transport=httpx.MockTransport(handler)))
    caplog.set_level("INFO", logger="collector.shipper")
    for i in range(3):
        shipper.deliver([sig(i)])
    lost = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelname == "INFO"  # once per outage, not once per batch
    up["now"] = True
    shipper.deliver([sig(9)])
    back = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(back) == 1 and back[0].levelname == "INFO" and spool.signals == 0
