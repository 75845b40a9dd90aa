"""The agent uploads PyTorch Flight Recorder dumps once each, when complete, with job and rank from name or pod."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from collector.checkpoint import CheckpointStore
from collector.flight_recorder import FlightRecorderSource, HttpDumpUploader
from collector.podmeta import StaticPodMetadata
from collector.shipper import Outcome
from kmend.commands.agent import AgentSettings, build_agent
from tests.agent_helpers import TOKEN, Service
from tests.conftest import free_port

GLOO = Path(__file__).parent / "fixtures" / "flight_recorder"


@dataclass
class RecordingUploader:
    """Answers with a fixed outcome and remembers what it was sent."""

    outcome: Outcome = Outcome.ACCEPTED
    sent: list[tuple[str, int, str, int]] = field(default_factory=list)

    def upload(self, *, job: str, rank: int, node: str, body: bytes) -> Outcome:
        self.sent.append((job, rank, node, len(body)))
        return self.outcome


@dataclass
class Clock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, free_port())
    svc.start()
    yield svc
    with contextlib.suppress(AssertionError):
        svc.stop()
    svc.kmend.store.close()


def test_dumps_reach_the_service_and_name_the_rank_that_never_joined(tmp_path: Path, service: Service) -> None:
    root = tmp_path / "fr"
    for r in (0, 2):
        # PyTorch's current default file name (comm_lib_trace_rank_) behind a job-named prefix.
        _write(root / f"gloo-job.comm_lib_trace_rank_{r}", (GLOO / f"gloo_trace_rank_{r}").read_bytes())
    clock = Clock()
    src = FlightRecorderSource(node="gpu-1", root=root, uploader=HttpDumpUploader(service.url, token=TOKEN),
                               settle_s=2.0, clock=clock)
    assert src.poll().cursors == {}  # just seen: maybe still being written
    clock.t += 2.5
    polled = src.poll()
    assert src.uploaded == 2 and set(polled.cursors) == {"gloo-job.comm_lib_trace_rank_0",
                                                              "gloo-job.comm_lib_trace_rank_2"}
    src.close()
    found = service.kmend.evaluate(now=service.kmend.detector_now() + 60).findings
    [f] = [x for x in found if x.rule_id == "flight-recorder"]
    assert f.where.rank == 1 and f.where.job == "gloo-job"


def test_a_dump_still_growing_waits_and_each_dump_is_uploaded_once_across_restarts(tmp_path: Path) -> None:
    root, clock, up = tmp_path / "fr", Clock(), RecordingUploader()
    path = _write(root / "llm.nccl_trace_rank_5", b"\x80\x04partial")
    src = FlightRecorderSource(node="n", root=root, uploader=up, settle_s=1.0, clock=clock)
    src.poll()
    clock.t += 0.5
    with open(path, "ab") as fh:
        fh.write(b"more bytes")
    os.utime(path, ns=(1, 1))
    clock.t += 1.0
    src.poll()
    assert up.sent == []  # it changed since the last look
    clock.t += 1.0
    polled = src.poll()
    assert up.sent == [("llm", 5, "n", path.stat().st_size)]
    store = CheckpointStore(tmp_path / "cp.json")
    store.update(src.name, polled.cursors)
    store.save()

    again = FlightRecorderSource(node="n", root=root, uploader=up, settle_s=1.0, clock=clock,
                                 resume=CheckpointStore(tmp_path / "cp.json").section("flight-recorder"))
    for _ in range(3):
        clock.t += 2
        again.poll()
    assert len(up.sent) == 1
    # The next run of the job overwrites the dump: that is a new dump.
    path.write_bytes(b"a new dump of another timeout")
    for _ in range(2):
        clock.t += 2
        again.poll()
    assert len(up.sent) == 2


def test_job_comes_from_pod_labels_or_directory_and_rank_from_the_file_name(tmp_path: Path) -> None:
    root, clock, up = tmp_path / "fr", Clock(), RecordingUploader()
    _write(root / "train_llama-worker-3_8d7c6b5a-0000-1111-2222-333344445555" / "nccl_trace_rank_27", b"x")
    _write(root / "bert-ft" / "nccl_trace_rank_4", b"y")
    _write(root / "nccl_trace_rank_9", b"z")  # the default prefix: nothing says which job
    _write(root / "notes.txt", b"not a dump")
    pods = StaticPodMetadata({"train/llama-worker-3": {"training.kubeflow.org/job-name": "llama-70b",
                                                       "training.kubeflow.org/replica-index": "3"}})
    src = FlightRecorderSource(node="n", root=root, uploader=up, pod_metadata=pods, settle_s=0.0, clock=clock)
    src.poll()
    polled = src.poll()
    # A dump in a pod's directory names its job with the pod's namespace, as the job's progress does.
    assert sorted(up.sent) == [("bert-ft", 4, "n", 1), ("train/llama-70b", 27, "n", 1)]
    assert polled.errors == 1 and polled.cursors["nccl_trace_rank_9"]["state"] == "no-job"


def test_service_away_retries_later_and_a_refused_dump_is_not_retried(tmp_path: Path) -> None:
    root, clock = tmp_path / "fr", Clock()
    _write(root / "j.nccl_trace_rank_0", b"dump")
    up = RecordingUploader(Outcome.UNAVAILABLE)
    src = FlightRecorderSource(node="n", root=root, uploader=up, settle_s=0.0, retry_s=10.0, clock=clock)
    src.poll()
    assert src.poll().cursors == {} and len(up.sent) == 1
    clock.t += 5
    src.poll()
    assert len(up.sent) == 1  # backing off, not one connection attempt per poll
    up.outcome = Outcome.REJECTED
    clock.t += 5
    assert src.poll().cursors["j.nccl_trace_rank_0"]["state"] == "rejected"
    src.poll()
    assert len(up.sent) == 2
    # Deleted dumps are forgotten, so the checkpoint does not grow without bound.
    (root / "j.nccl_trace_rank_0").unlink()
    assert src.poll().cursors == {"j.nccl_trace_rank_0": None}


def test_a_failed_pod_lookup_is_retried_not_taken_as_no_job(tmp_path: Path) -> None:
    root, clock, up = tmp_path / "fr", Clock(), RecordingUploader()
    _write(root / "train_llama-worker-0_8d7c6b5a-0000-1111-2222-333344445555" / "comm_lib_trace_rank_0", b"x")
    pods = StaticPodMetadata({"train/llama-worker-0": {"kmend.io/job": "llama"}})
    real = pods.labels

    def flaky(namespace: str, pod: str, uid: str) -> dict[str, str] | None:
        if pods.calls == 0:
            pods.calls += 1
            raise ConnectionError("API server away")
        labels = real(namespace, pod, uid)
        return dict(labels) if labels else None

    pods.labels = flaky  # type: ignore[method-assign]
    src = FlightRecorderSource(node="n", root=root, uploader=up, pod_metadata=pods, settle_s=0.0, clock=clock)
    src.poll()
    assert src.poll().cursors == {} and up.sent == []
    src.poll()
    assert up.sent == [("train/llama", 0, "n", 1)]


def test_kmend_agent_uploads_dumps_once_across_a_restart(tmp_path: Path, service: Service) -> None:
    root = tmp_path / "fr"
    for r in (0, 2):
        _write(root / "gloo-job" / f"comm_lib_trace_rank_{r}", (GLOO / f"gloo_trace_rank_{r}").read_bytes())
    (tmp_path / "token").write_text(TOKEN)
    settings = AgentSettings(node="gpu-1", state_dir=tmp_path / "state", pods_root=tmp_path / "pods", kernel="off",
                             ib_root=tmp_path / "no-ib", nvml=False, pod_labels=False, process_exits=False,
                             service_url=service.url,
                             token_file=tmp_path / "token", flight_recorder_dir=root, flight_recorder_settle_s=0.0)
    for _ in range(2):  # the agent restarts in between: the checkpoint remembers what was uploaded
        agent = build_agent(settings)
        fr = next(s for s in agent.sources if isinstance(s, FlightRecorderSource))
        for _ in range(2):
            agent.run_once()
        agent.flush()
        uploaded = fr.uploaded
        fr.close()
    assert uploaded == 0  # the second agent uploaded nothing again
    assert set(CheckpointStore(settings.state_dir / "checkpoints.json").section("flight-recorder")) == {
        "gloo-job/comm_lib_trace_rank_0", "gloo-job/comm_lib_trace_rank_2"}
    found = service.kmend.evaluate(now=service.kmend.detector_now() + 60).findings
    [f] = [x for x in found if x.rule_id == "flight-recorder"]
    assert f.where.rank == 1 and f.where.job == "gloo-job"
