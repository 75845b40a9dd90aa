"""A rank that prints numbered steps (a progress bar) and lines that number none (a Trainer's loss dict every
`logging_steps`): the dicts' own count is no step of the rank, so it never reads as the steps going back (a
restart that wiped the job's detector state every `logging_steps`), and a slow rank is still named."""

from __future__ import annotations

from analyzer.detectors.suite import DetectorSuite
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass, Finding
from collector.signal import LogLine, Signal, Source

BAR = " {pct:2d}%|▌         | {step}/600 [00:01<00:19,  2.90it/s]"
RULES = load_progress_rules([default_progress_rules_dir()])
LOSS = "{'loss': 4.8512, 'grad_norm': 1.23, 'learning_rate': 4.9e-05, 'epoch': 0.05}"


def _line(rank: int, i: str, ts: float, text: str) -> Signal:
    return Signal(f"gpu-1/container/{rank}/{i}", "gpu-1", Source.CONTAINER, ts,
                  LogLine(text, namespace="nlp", pod=f"bert-{rank}", job="bert", rank=rank))


def _run(suite: DetectorSuite, steps: int, *, slow_rank: int | None = None, logging_steps: int = 10) -> list[Finding]:
    found: list[Finding] = []
    t = 1_700_000_000.0
    for step in range(1, steps + 1):
        batch = []
        for r in range(4):
            late = 0.3 if r == slow_rank and step > 10 else 0.0
            batch.append(_line(r, f"b{step}", t + late, BAR.format(pct=step * 100 // 600, step=step)))
            if step % logging_steps == 0:
                batch.append(_line(r, f"d{step}", t + late + 0.01, LOSS))
        suite.observe(batch)
        t += 1.0
        found += suite.evaluate(t)
    return found


def test_loss_dicts_between_bar_steps_are_no_restart() -> None:
    suite = DetectorSuite(RULES)
    assert _run(suite, 80) == []
    [job] = suite.book.jobs.values()
    assert job.run == 0 and {r: s.last_step for r, s in job.ranks.items()} == {0: 80, 1: 80, 2: 80, 3: 80}


def test_a_slow_rank_printing_a_bar_and_loss_dicts_is_named_within_30_steps() -> None:
    found = [f for f in _run(DetectorSuite(RULES), 80, slow_rank=2) if f.fault_class is FaultClass.STRAGGLER]
    assert [f.where.rank for f in found] == [2]
    assert int(found[0].fields["step"]) - 10 <= 30


def _hangs(found: list[Finding]) -> list[str]:
    return [f.message for f in found if f.fault_class is FaultClass.HANG]


def test_loss_dicts_after_a_bar_record_keep_the_job_alive() -> None:
    # A Trainer's bar redraws with carriage returns: the container runtime writes it to the pod's log only when
    # 16 KiB of redraws fill a record (hundreds of steps), while its loss dict ends a line every `logging_steps`.
    # After a record of the bar, the dicts (no step number) must still count as progress.
    suite = DetectorSuite(RULES)
    t = 1_700_000_000.0
    found: list[Finding] = []
    for step in range(1, 1201):
        t += 0.1
        batch = [_line(0, f"d{step}", t, LOSS)] if step % 10 == 0 else []
        if step == 600:  # the bar's record: every redraw so far, one line each
            batch += [_line(0, f"b{s}", t, f"  0%|          | {s}/100000 [00:{s // 10:02d}<4:37:46,  9.99it/s]")
                      for s in range(1, 601)]
        suite.observe(batch)
        if step % 10 == 0:
            found += suite.evaluate(t)
    assert _hangs(found) == []
    # And when the dicts stop, the silence is a hang from the last of them, within the target.
    while t < 1_700_000_000.0 + 120 + 30 and not _hangs(found):
        t += 0.5
        found += suite.evaluate(t)
    [hang] = [f for f in found if f.fault_class is FaultClass.HANG]
    assert hang.ts - (1_700_000_000.0 + 120.0) <= 15.0
