"""Progress extraction: the rules/progress loader, the extractor, the training-script hook and its file source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analyzer.progress import ProgressExtractor
from analyzer.progress_rules import (
    ProgressKind,
    ProgressRule,
    default_progress_rules_dir,
    load_progress_pack,
    load_progress_rules,
)
from analyzer.rules import RuleError
from collector.progress_file import ProgressFileSource
from collector.progress_hook import ProgressReporter, report_step
from collector.signal import ProgressSample, Source
from collector.wire import SignalIn, to_record, to_wire
from tests.builders import container, kernel


@pytest.fixture(scope="module")
def rules() -> list[ProgressRule]:
    return load_progress_rules([default_progress_rules_dir()])


def test_every_shipped_pack_loads_and_covers_the_common_trainers(rules: list[ProgressRule]) -> None:
    packs = {r.pack for r in rules}
    assert {"megatron", "deepspeed", "huggingface", "lightning", "torchtitan", "generic"} <= packs
    assert rules[-1].pack == "generic"  # tried last
    assert all(r.references for r in rules)


def _pack(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    return p


def test_an_example_whose_extracted_value_is_wrong_fails_at_load(tmp_path: Path) -> None:
    p = _pack(tmp_path, """
rules:
  - id: wrong-step
    description: d
    kind: step
    contains: "step"
    pattern: 'step (?P<step>\\d+)'
    examples: [{line: "step 12", step: 13}]
    references: [https://example.org/a]
""")
    with pytest.raises(RuleError) as err:
        load_progress_pack(p)
    assert (err.value.rule_id, err.value.field) == ("wrong-step", "examples[0].step")


def test_an_unknown_named_group_fails_at_load(tmp_path: Path) -> None:
    p = _pack(tmp_path, """
rules:
  - id: odd-group
    description: d
    kind: step
    contains: "step"
    pattern: 'step (?P<iteration>\\d+)'
    examples: [{line: "step 12"}]
    references: [https://example.org/a]
""")
    with pytest.raises(RuleError, match="unknown named groups"):
        load_progress_pack(p)


def test_megatron_line_gives_step_total_and_step_time(rules: list[ProgressRule]) -> None:
    line = ("[rank0]:  iteration      100/  500000 | consumed samples: 102400 | elapsed time per iteration (ms): "
            "1201.3 | learning rate: 3.000E-04")
    [ev] = ProgressExtractor(rules).extract([container("gpu-1", line, rank=7)])
    assert (ev.job, ev.rank, ev.node, ev.step, ev.total, ev.kind) == ("job-a", 7, "gpu-1", 100, 500000,
                                                                      ProgressKind.STEP)
    assert ev.step_time == pytest.approx(1.2013) and ev.rule_id == "megatron-iteration"


def test_rank_comes_from_torchrun_prefix_when_metadata_has_none(rules: list[ProgressRule]) -> None:
    [ev] = ProgressExtractor(rules).extract([container("gpu-1", "[rank3]: step 12 loss 0.4127 step_time=0.052")])
    assert ev.rank == 3 and ev.step == 12 and ev.step_time == pytest.approx(0.052)


def test_hf_trainer_logs_without_a_step_count_as_consecutive_steps(rules: list[ProgressRule]) -> None:
    ex = ProgressExtractor(rules)
    lines = [container("gpu-1", f"{{'loss': 0.{i}, 'learning_rate': 0.001, 'epoch': 0.0{i}}}", rank=0)
             for i in range(1, 4)]
    assert [e.step for e in ex.extract(lines)] == [1, 2, 3]


def test_checkpoint_lines_are_pause_and_resume_markers(rules: list[ProgressRule]) -> None:
    evs = ProgressExtractor(rules).extract([
        container("gpu-1", "saving checkpoint at iteration    1000 to /ckpt", rank=0),
        container("gpu-1", "  successfully saved checkpoint at iteration    1000 to /ckpt", rank=0),
    ])
    assert [(e.kind, e.step) for e in evs] == [(ProgressKind.PAUSE, 1000), (ProgressKind.RESUME, 1000)]


def test_unrelated_lines_and_lines_of_no_job_give_nothing(rules: list[ProgressRule]) -> None:
    ex = ProgressExtractor(rules)
    assert ex.extract([container("gpu-1", "NCCL INFO Channel 00/32 : 0 1 2 3")]) == []
    assert ex.extract([kernel("gpu-1", "step 4 loss 1.0")]) == []  # no pod, no job: nothing to compare with
    [ev] = ex.extract([container("gpu-1", "step 4 loss 1.0", job=None, pod="trainer-0")])
    # Without a job label the pod stands for it, in its namespace.
    assert (ev.namespace, ev.job, ev.key) == ("training", "trainer-0", "training/trainer-0")


def test_hook_files_become_progress_signals_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 rules: list[ProgressRule]) -> None:
    monkeypatch.setenv("KMEND_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("KMEND_JOB", "llama")
    monkeypatch.setenv("RANK", "5")
    report_step(1, 0.25, {"compute": 0.2, "comm_wait": 0.05})
    report_step(2, 0.26)
    src = ProgressFileSource(tmp_path, node="gpu-9")
    first = src.poll().signals
    assert [s.payload.step for s in first if isinstance(s.payload, ProgressSample)] == [1, 2]
    assert first[0].source is Source.PROGRESS and first[0].id == "gpu-9/progress/llama.rank5.jsonl/0"
    assert src.poll().signals == []  # nothing new
    [ev, _] = ProgressExtractor(rules).extract(first)
    assert (ev.job, ev.rank, ev.phases["compute"]) == ("llama", 5, 0.2)


def test_a_partial_or_malformed_line_is_not_lost_or_fatal(tmp_path: Path) -> None:
    rep = ProgressReporter(tmp_path, "j", 0)
    rep.report_step(1, 0.1, ts=100.0)
    rep.close()
    path = tmp_path / "j.rank0.jsonl"
    with open(path, "a") as fh:
        fh.write("not json\n")
        fh.write(json.dumps({"ts": 101.0, "job": "j", "rank": 0, "step": 2})[:20])  # writer mid-append
    src = ProgressFileSource(tmp_path, node="n")
    assert [s.payload.step for s in src.poll().signals if isinstance(s.payload, ProgressSample)] == [1]
    assert src.skipped == 1
    with open(path, "a") as fh:
        fh.write(json.dumps({"ts": 101.0, "job": "j", "rank": 0, "step": 2})[20:] + "\n")
    assert [s.payload.step for s in src.poll().signals if isinstance(s.payload, ProgressSample)] == [2]


def test_without_a_progress_dir_the_hook_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KMEND_PROGRESS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    report_step(1, 0.1)
    assert list(tmp_path.iterdir()) == []


def test_progress_signals_survive_the_wire(tmp_path: Path) -> None:
    rep = ProgressReporter(tmp_path, "j", 3)
    rep.report_step(7, 1.5, {"compute": 1.2}, ts=1_700_000_000.0)
    rep.close()
    [sig] = ProgressFileSource(tmp_path, node="n").poll().signals
    assert to_record(SignalIn.model_validate(to_wire(sig))) == sig
