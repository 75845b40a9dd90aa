"""Job, rank and node of every line, off-cluster as in-cluster: pod names, a labels file, rank prefixes (eight ranks
in one pod), torchrun's environment in the hook; the live agent and `kmend analyze` agree on the same CRI files."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from analyzer.engine import MultiMatcher
from analyzer.progress import ProgressEvent, ProgressExtractor
from analyzer.progress_rules import ProgressRule, default_progress_rules_dir, load_progress_rules
from analyzer.rules import default_rules_dir, load_rules
from collector.bundle import BundleSource
from collector.metrics import AgentMetrics
from collector.progress_file import ProgressFileSource
from collector.progress_hook import report_step
from collector.signal import LogLine, Signal
from collector.sources.cri import CriLogSource
from collector.spool import DiskSpool
from collector.wire import SignalIn, to_record
from kmend.bundle_analysis import collect
from kmend.commands.agent import AgentSettings, build_agent
from tests.agent_helpers import CriWriter
from tests.conftest import free_port

NODE = "gpu-node-4"


@pytest.fixture(scope="module")
def rules() -> list[ProgressRule]:
    return load_progress_rules([default_progress_rules_dir()])


def _agent_signals(tmp_path: Path, metrics: AgentMetrics | None = None, **kw: Any) -> list[Signal]:
    """Run the real agent once over ``tmp_path/pods`` (no service: batches land in its spool) and read them back."""
    state = tmp_path / "state"
    settings = AgentSettings(**{"node": NODE, "state_dir": state, "pods_root": tmp_path / "pods", "kernel": "off",
                                "ib_root": tmp_path / "no-ib", "nvml": False, "pod_labels": False,
                                "service_url": f"http://127.0.0.1:{free_port()}",
                                # Every line as read (step-line summaries keep the same job and rank:
                                # tests/test_progress_lines_edge.py).
                                "progress_summary_s": 0, **kw})
    agent = build_agent(settings, metrics=metrics)
    agent.run_once()
    agent.flush()
    spool = DiskSpool(state / "spool")
    out: list[Signal] = []
    while (batch := spool.peek()) is not None:
        wire = json.loads(gzip.decompress(spool.read(batch)))["signals"]
        out.extend(to_record(SignalIn.model_validate(s)) for s in wire)
        spool.pop(batch)
    return out


def _who(events: list[ProgressEvent]) -> set[tuple[str, int, str]]:
    return {(e.job, e.rank, e.node) for e in events}


def _two_pods(pods: Path) -> None:
    for r in (0, 1):
        w = CriWriter(pods, ns="train", pod=f"llama-worker-{r}", uid=f"u{r}")
        for step in (1, 2, 3):
            w.line(f"step {step} loss {2.0 - step / 10:.2f}")


def test_off_cluster_the_pods_of_one_job_are_one_job_with_a_rank_each(tmp_path: Path,
                                                                      rules: list[ProgressRule]) -> None:
    _two_pods(tmp_path / "pods")
    events = ProgressExtractor(rules).extract(_agent_signals(tmp_path))
    assert _who(events) == {("llama", 0, NODE), ("llama", 1, NODE)}


def test_a_labels_file_names_job_and_rank_and_a_bad_one_is_one_line(tmp_path: Path, rules: list[ProgressRule],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _two_pods(tmp_path / "pods")
    labels = tmp_path / "labels.yaml"
    labels.write_text("train/llama-worker-0: {training.kubeflow.org/job-name: llama-70b, "
                      "training.kubeflow.org/replica-index: '4'}\n"
                      "llama-worker-1: {kmend.io/job: llama-70b, kmend.io/rank: '5'}\n")
    events = ProgressExtractor(rules).extract(_agent_signals(tmp_path, pod_labels_file=labels))
    assert _who(events) == {("llama-70b", 4, NODE), ("llama-70b", 5, NODE)}
    labels.write_text("[not, a, mapping]")
    from kmend.cli import main

    assert main(["--log-level", "error", "agent", "--state-dir", str(tmp_path / "s2"), "--pod-labels-file",
                 str(labels), "--no-nvml", "--kernel", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "KMEND_AGENT_POD_LABELS_FILE" in err[0] and str(labels) in err[0]


def test_eight_ranks_logging_through_one_pod_are_eight_ranks(tmp_path: Path, rules: list[ProgressRule]) -> None:
    w = CriWriter(tmp_path / "pods", ns="train", pod="gpt-node-0", uid="u0")
    for step in (1, 2):
        for r in range(8):
            w.line(f"[rank{r}]: iter {step}: loss 3.{r}, time 250.0ms")
    events = ProgressExtractor(rules).extract(_agent_signals(tmp_path))
    assert _who(events) == {("gpt-node", r, NODE) for r in range(8)}


def test_the_prefilter_drops_are_counted(tmp_path: Path) -> None:
    w = CriWriter(tmp_path / "pods")
    for i in range(5):
        w.line(f"dataloader worker {i} prefetched 64 samples")
    w.line("{'loss': 2.3, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}")
    metrics = AgentMetrics(CollectorRegistry())
    signals = _agent_signals(tmp_path, metrics=metrics)
    assert [s.text for s in signals] == ["{'loss': 2.3, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}"]
    assert metrics.registry.get_sample_value("kmend_agent_lines_filtered_total", {"source": "container"}) == 5


def test_a_progress_bar_that_never_ends_its_line_is_shipped_redraw_by_redraw(tmp_path: Path,
                                                                             rules: list[ProgressRule]) -> None:
    w = CriWriter(tmp_path, ns="train", pod="bert-0", uid="u0")
    src = CriLogSource(node=NODE, root=tmp_path, clock=lambda: 0.0)
    # The runtime cuts a line that has no newline yet into partial records.
    w.line("[rank0]:\r  5%|▌         | 1/20 [00:00<00:01, 14.21it/s]\r 10%|█         | 2/20 [00:00<00:01, 16.3",
           tag="P")
    w.line("9it/s]\r 15%|█▌        | 3/20 [00:00<00:01, 16.39it/s]\r 20%|██        | 4/2", tag="P")
    events = ProgressExtractor(rules).extract(src.poll().signals)
    assert [(e.step, e.rank) for e in events] == [(1, 0), (3, 0)]  # the latest complete redraw of each record
    w.line("0 [00:00<00:00, 16.39it/s]\r 25%|██▌       | 5/20 [00:00<00:00, 16.39it/s]")
    events = ProgressExtractor(rules).extract(src.poll().signals)
    assert [(e.step, e.rank) for e in events] == [(5, 0)]


def test_the_hook_records_torchruns_environment_and_gets_the_pods_job(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      rules: list[ProgressRule]) -> None:
    monkeypatch.setenv("KMEND_PROGRESS_DIR", str(tmp_path / "progress"))
    monkeypatch.delenv("KMEND_JOB", raising=False)
    env = {"RANK": "11", "LOCAL_RANK": "3", "GROUP_RANK": "1", "WORLD_SIZE": "16",
           "TORCHELASTIC_RUN_ID": "f00d", "HOSTNAME": "llama-worker-1", "POD_NAMESPACE": "train"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    report_step(7, 0.5)
    [rec] = [json.loads(x) for x in next((tmp_path / "progress").iterdir()).read_text().splitlines()]
    assert (rec["rank"], rec["local_rank"], rec["group_rank"], rec["run_id"], rec["pod"], rec["namespace"]) == (
        11, 3, 1, "f00d", "llama-worker-1", "train")
    [ev] = ProgressExtractor(rules).extract(ProgressFileSource(tmp_path / "progress", NODE).poll().signals)
    assert (ev.job, ev.rank) == ("llama", 11)  # the job the pod's log lines have, not the run id


def test_live_agent_and_offline_analyze_agree_on_job_rank_and_node(tmp_path: Path,
                                                                   rules: list[ProgressRule]) -> None:
    pods = tmp_path / "pods"
    # Real pod UIDs: `kmend analyze` recognises a /var/log/pods directory by them.
    one = CriWriter(pods, ns="train", pod="llama-worker-0", uid="5b0e3c1a-0f4e-4a57-9d6c-1a2b3c4d5e60")
    two = CriWriter(pods, ns="train", pod="llama-worker-1", uid="5b0e3c1a-0f4e-4a57-9d6c-1a2b3c4d5e61")
    multi = CriWriter(pods, ns="train", pod="bert-node-0", uid="5b0e3c1a-0f4e-4a57-9d6c-1a2b3c4d5e62")
    for step in (1, 2, 3):
        one.line(f"[titan] 2026-03-02 09:00:0{step},000 - root - INFO - step: {step}  loss:  7.6  memory: 66.91GiB"
                 "(37.51%)  tps: 10,050  tflops: 314.71  mfu: 13.99%")
        two.line(f"{{'loss': 2.{step}, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.{step}}}")
        for r in range(4):
            multi.line(f"[rank{r}]: iter {step}: loss 3.{r}, time 250.0ms")
        multi.line(f"[rank2]: [Rank 2] step={step}, skipped=0, lr=[5e-05], mom=[[0.9, 0.999]]")
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"train/llama-worker-1": {"kmend.io/job": "llama", "kmend.io/rank": "1"}}))

    live_signals = _agent_signals(tmp_path, pod_labels_file=labels)
    live = ProgressExtractor(rules).extract(live_signals)
    source = BundleSource([str(pods)], node=NODE,
                          pod_labels={"train/llama-worker-1": {"kmend.io/job": "llama", "kmend.io/rank": "1"}})
    offline_signals, _, _ = collect(source, MultiMatcher(load_rules([default_rules_dir()])), rules)
    offline = ProgressExtractor(rules).extract(offline_signals)

    def steps(evs: list[ProgressEvent]) -> set[tuple[str, int, str, int | None]]:
        return {(e.job, e.rank, e.node, e.step) for e in evs}

    assert steps(live) == steps(offline)
    assert _who(live) == {("llama", 0, NODE), ("llama", 1, NODE)} | {("bert-node", r, NODE) for r in range(4)}

    def identity(signals: list[Signal]) -> dict[str, tuple[str | None, int | None, str]]:
        return {s.text: (s.payload.job, s.payload.rank, s.node) for s in signals if isinstance(s.payload, LogLine)}

    # Line by line too: the fault rules see the same job, rank and node either way.
    live_ids, offline_ids = identity(live_signals), identity(offline_signals)
    assert live_ids and all(offline_ids[text] == who for text, who in live_ids.items())


def test_the_job_flag_names_every_pod_on_the_node(tmp_path: Path, rules: list[ProgressRule]) -> None:
    _two_pods(tmp_path / "pods")
    events = ProgressExtractor(rules).extract(_agent_signals(tmp_path, job="bert-ft"))
    assert _who(events) == {("bert-ft", 0, NODE), ("bert-ft", 1, NODE)}


def test_analyze_refuses_a_bad_labels_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kmend.cli import build_parser

    _two_pods(tmp_path / "pods")
    labels = tmp_path / "labels.json"
    labels.write_text('{"llama-worker-0": "not a mapping"}')
    args = build_parser().parse_args(["analyze", str(tmp_path / "pods"), "--pod-labels-file", str(labels)])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(labels) in err[0]
