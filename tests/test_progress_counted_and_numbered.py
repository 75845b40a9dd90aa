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
