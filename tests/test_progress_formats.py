"""Progress from what unmodified trainers print: each format, after any prefix, through the extractor and the
agent's prefilter (real lines; where a line was captured from a run here, the trainer's version is named)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.progress import ProgressEvent, ProgressExtractor
from analyzer.progress_rules import ProgressKind, ProgressRule, default_progress_rules_dir, load_progress_rules
from collector.prefilter import RegexPrefilter
from kmend.commands.agent import AgentSettings, build_prefilter
from tests.builders import container


@pytest.fixture(scope="module")
def rules() -> list[ProgressRule]:
    return load_progress_rules([default_progress_rules_dir()])


@pytest.fixture(scope="module")
def prefilter(tmp_path_factory: pytest.TempPathFactory) -> RegexPrefilter:
    tmp = tmp_path_factory.mktemp("agent")
    pf = build_prefilter(AgentSettings(node="n", state_dir=tmp, nvml=False, pod_labels=False))
    assert pf is not None
    return pf


def _events(rules: list[ProgressRule], lines: list[str], *, rank: int | None = None) -> list[ProgressEvent]:
    ex = ProgressExtractor(rules)
    return ex.extract([container("n1", line, job="llama", rank=rank, ts=1000.0 + i) for i, line in enumerate(lines)])


# Real Trainer output: the metrics dict has no 'step' (transformers 4.x, from the linked threads, and 5.23
# as captured from a torchrun run here, where values are strings); keys come in any order.
HF_LINES = [
    "{'loss': 2.119, 'grad_norm': 37.657958984375, 'learning_rate': 4.5833333333333334e-05, 'epoch': 0.25}",
    "{'loss': '4.714', 'grad_norm': '0.8162', 'learning_rate': '4.75e-05', 'epoch': '0.003906'}",
    "[rank0]:2026-03-02 09:00:04,113 {'epoch': 0.5, 'loss': 1.6462, 'grad_norm': 17.5, 'learning_rate': 4.1e-05}",
    "2026-03-02T09:00:06Z trainer-0 {'loss': 1.5798, 'grad_norm': 14.87, 'learning_rate': 3.75e-05, 'epoch': 0.75}",
]


def test_hugging_face_trainer_dicts_without_a_step_count_as_consecutive_steps(rules: list[ProgressRule]) -> None:
    # Only the main process prints them; its pod says rank 0.
    evs = _events(rules, HF_LINES, rank=0)
    want = [(ProgressKind.STEP, n, "hf-trainer-logs") for n in (1, 2, 3, 4)]
    assert [(e.kind, e.step, e.rule_id) for e in evs] == want


def test_a_dict_that_names_its_step_gives_that_step_whatever_follows(rules: list[ProgressRule]) -> None:
    line = "[rank2]: {'loss': 0.8123, 'epoch': 0.12, 'step': 40, 'step_time': 0.231}"
    [ev] = _events(rules, [line])
    assert (ev.step, ev.rank) == (40, 2)


def test_eval_and_summary_dicts_are_not_training_steps(rules: list[ProgressRule]) -> None:
    # The summary dict is the end of training (an END event for the hang detector), never a step.
    assert [e for e in _events(rules, [
        "{'eval_loss': 0.7353992462158203, 'eval_runtime': 132.7399, 'eval_samples_per_second': 80.39, 'epoch': 0.03}",
        "{'train_runtime': '0.3694', 'train_samples_per_second': '433.1', 'train_steps_per_second': '54.14', "
        "'train_loss': '4.708', 'epoch': '0.03906'}",
    ]) if e.kind is not ProgressKind.END] == []


def test_a_tqdm_bar_redrawn_inside_one_line_yields_its_latest_redraw(rules: list[ProgressRule]) -> None:
    line = ("\r  0%|          | 0/20 [00:00<?, ?it/s]\r  5%|▌         | 1/20 [00:00<00:01, 14.21it/s]"
            "\r 10%|█         | 2/20 [00:00<00:01, 16.39it/s]")
    [ev] = _events(rules, [line])
    assert (ev.step, ev.total, ev.rule_id) == (2, 20, "tqdm-bar")
    assert ev.step_time == pytest.approx(1 / 16.39)


def test_lightning_bar_steps_keep_rising_across_epochs(rules: list[ProgressRule]) -> None:
    evs = _events(rules, [
        "Epoch 0:  94%|█████████▍| 17/18 [00:40<00:02,  2.39s/it, loss=9.2, v_num=1]",
        "Epoch 0: 100%|██████████| 18/18 [00:42<00:00,  2.38s/it, loss=9.1, v_num=1]",
        "Epoch 1:   6%|▌         | 1/18 [00:02<00:40,  2.40s/it, loss=9.0, v_num=1]",
        "\x1b[2KEpoch 0/-2 \x1b[35m━\x1b[0m\x1b[35m╸\x1b[0m\x1b[90m━━━━━━━━━━━━━━━━\x1b[0m 1/10 "
        "\x1b[2m0:00:00 • -:--:--"
        "\x1b[0m \x1b[2;4m0.00it/s\x1b[0m \x1b[3mtrain_loss: 2.068\x1b[0m",
    ])
    assert [e.step for e in evs[:3]] == [17, 18, 19]
    assert evs[0].total is None  # the bar's total is the epoch's, not the run's
    assert evs[3].rule_id == "lightning-rich-bar"


@pytest.mark.parametrize(("line", "step", "rank"), [
    # Megatron-LM after torchrun's prefix
    ("[rank3]:  iteration      100/  500000 | consumed samples: 102400 | elapsed time per iteration (ms): 512.3 |"
     " learning rate: 3.0E-04 |", 100, 3),
    # DeepSpeed log_dist names the rank inside the line
    ("[2022-03-11 02:06:58,985] [INFO] [logging.py:69:log_dist] [Rank 0] step=40, skipped=2, lr=[5e-05], "
     "mom=[[0.9, 0.999]]", 40, 0),
    ("[2023-07-25 21:03:17,269] [INFO] [timer.py:215:stop] epoch=0/micro_step=34/global_step=34, "
     "RunningAvgSamplesPerSec=7.86, CurrSamplesPerSec=8.0, MemAllocated=59.65GB, MaxMemAllocated=63.31GB", 34, None),
    ("steps: 40 loss: 2.0592 iter time (s): 0.293 samples/sec: 874.900", 40, None),
    # torchtitan
    ("[rank1]:[titan] 2025-06-16 22:30:50,322 - root - INFO - step: 200  loss:  6.1384  memory: 49.66GiB(52.28%)"
     "  tps: 5,856  tflops: 339.16  mfu: 34.29%", 200, 1),
    # NeMo 2
    ("Training epoch 0, iteration 120/149 | lr: 3e-05 | consumed_samples: 121 | global_batch_size: 1 | "
     "global_step: 120 | reduced_train_loss: 1.233 | train_step_timing in s: 0.03146", 120, None),
    # Composer
    ("[batch=16/625]:", 16, None),
    # nanoGPT after a timestamp, and under Slurm's srun --label prefix
    ("2023-03-22 09:31:45 iter 2980: loss 3.8993, time 1099.18ms, mfu 15.34%", 2980, None),
    ("5: iter 100: loss 4.2345, time 151.22ms, mfu 31.40%", 100, 5),
    # plain step / iter / epoch-and-step, after torchrun's older role prefix
    ("[default3]:ep 55 train, step 1347, ce 0.355, 0.838 sec/step, elapsed 0:16:59", 1347, 3),
    ("[rank6]: 2026-03-02 09:00:01 host-7 | step 12 loss 0.41", 12, 6),
    ("INFO:tensorflow:global step 2: loss = 72.8609 (17.053 sec/step)", 2, None),
    # litgpt: "iter" counts micro-batches, "step" optimizer steps; the step is the progress
    ("Ep 1 | iter 4 | step 1: loss train (curr): 1.585 | iter time: 181.34 ms (opt.step)", 1, None),
    ("iteration 7/100 | lm loss 2.31", 7, None),
])
def test_each_trainer_format_after_any_prefix(rules: list[ProgressRule], prefilter: RegexPrefilter, line: str,
                                              step: int, rank: int | None) -> None:
    [ev] = _events(rules, [line])
    assert ev.step == step and ev.kind is ProgressKind.STEP
    assert ev.rank == (-1 if rank is None else rank)
    # The node agent ships the line: in a CRI file it sits behind the runtime's prefix.
    assert prefilter.matches(line)
    cri = f"2026-03-02T09:00:01.000000001Z stdout F {line}\n".encode()
    assert prefilter.scan(b"2026-03-02T09:00:00.1Z stdout F noise\n" + cri) != []


@pytest.mark.parametrize("line", HF_LINES)
def test_the_agent_prefilter_keeps_trainer_dicts(prefilter: RegexPrefilter, line: str) -> None:
    assert prefilter.matches(line)


def test_lines_that_only_mention_steps_are_not_progress(rules: list[ProgressRule]) -> None:
    assert _events(rules, [
        "stepping into the data loader",
        "[2021-04-29 09:07:25,567] [INFO] [config.py:745:print]   steps_per_print .............. 10",
        "Average iter time: 0.1862 seconds",
    ]) == []


def test_a_shipped_pack_file_names_the_trainers_it_covers() -> None:
    names = {p.stem for p in Path(default_progress_rules_dir()).glob("*.yaml")}
    assert {"huggingface", "lightning", "megatron", "deepspeed", "torchtitan", "nemo", "composer", "tqdm",
            "generic"} <= names
