"""Trainers' step lines summarised by the node agent, as hook progress is: one summary per rank per window instead of
every step line, read by the service's detectors as the lines were; lines the service must read itself (a fault
rule matches them too, counted steps, the run's last step with its total, pauses) still go as lines, after the
steps before them; with summaries off every line is shipped as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from analyzer.progress import ProgressExtractor
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from collector.progress_summary import LineStep, SummarisedProgress, thin
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.sources.base import Poll
from kmend.commands.agent import AgentSettings, build_agent, build_line_steps
from tests.agent_helpers import CriWriter, spooled
from tests.conftest import free_port

MEGATRON = (" iteration {step:8d}/  250000 | consumed samples:       124928 | elapsed time per iteration (ms): {ms} |"
            " learning rate: 9.150E-06 | global batch size:  1024 | lm loss: 2.504220E+00 | loss scale: 1.0 |")
HF_TRAINER = "{'loss': 1.8123, 'grad_norm': 0.93, 'learning_rate': 4.9e-05, 'epoch': 0.12}"
OOM_AT_STEP = "[rank1]: step 12: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def _settings(tmp_path: Path, **kw: Any) -> AgentSettings:
    # These pods run no process: an agent watching /proc would (rightly) report their ranks as exited once their
    # logs are a second old; what is shipped of their lines is the subject here.
    base: dict[str, Any] = {"node": "gpu-3", "state_dir": tmp_path / "state", "pods_root": tmp_path / "pods",
                            "process_exits": False,
                            "kernel": "off", "ib_root": tmp_path / "no-ib", "nvml": False, "pod_labels": False,
                            "service_url": f"http://127.0.0.1:{free_port()}"}
    return AgentSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> LineStep:
    """The agent's step-line reader with the shipped rules (loaded once: they take a second)."""
    got = build_line_steps(_settings(tmp_path_factory.mktemp("agent"), progress_summary_s=5))
    assert got is not None
    return got


def _line(i: int, text: str, rank: int, ts: float) -> Signal:
    return Signal(f"gpu-3/container/llama-worker-{rank}/{i}", "gpu-3", Source.CONTAINER, ts,
                  LogLine(text, namespace="train", pod=f"llama-worker-{rank}", job="llama", rank=rank))


class _Lines:
    """A log source handing out prepared lines."""

    name = "container"

    def __init__(self) -> None:
        self.pending: list[Signal] = []

    def poll(self) -> Poll:
        out, self.pending = self.pending, []
        return Poll(signals=out, cursors={"f": len(out)})

    def close(self) -> None:
        pass


def test_step_lines_leave_as_one_summary_per_rank_that_the_service_reads_as_the_lines(steps: LineStep) -> None:
    now = [0.0]
    src = _Lines()
    summarised = SummarisedProgress(src, 5.0, clock=lambda: now[0], from_lines=steps)
    t = 1_700_000_000.0
    lines = [_line(10 * r + s, MEGATRON.format(step=s, ms=1000.0 + 100 * r + s), r, t + s)
             for s in range(1, 6) for r in (0, 1)]
    src.pending = list(lines)
    held = summarised.poll()
    assert held.signals == [] and held.cursors == {}  # the window is open: its lines' cursors wait
    now[0] = 6.0
    out = summarised.poll().signals
    assert [(s.source, s.payload.rank, s.payload.step, s.payload.samples) for s in out
            if isinstance(s.payload, ProgressSample)] == [(Source.PROGRESS, 0, 5, 5), (Source.PROGRESS, 1, 5, 5)]
    assert len(out) == 2
    # The service reads the two summaries as the ten lines: every step of every rank, at its time, with its time.
    service = ProgressExtractor(load_progress_rules([default_progress_rules_dir()]))
    by_line = [(e.job, e.namespace, e.rank, e.step, e.ts, e.step_time, e.kind) for e in service.extract(lines)]
    by_summary = [(e.job, e.namespace, e.rank, e.step, e.ts, e.step_time, e.kind) for e in service.extract(out)]
    assert sorted(by_summary) == sorted(by_line) and len(by_line) == 10


def test_a_fast_jobs_windows_close_at_the_same_steps_on_every_node(steps: LineStep) -> None:
    t = 1_700_000_000.0
    listed = []
    for start in (1, 7):  # two nodes' windows of one job stepping every 10 ms, not starting at the same step
        src = _Lines()
        summarised = SummarisedProgress(src, 5.0, clock=lambda: 0.0, from_lines=steps)
        src.pending = [_line(s, MEGATRON.format(step=s, ms=10.0), 0, t + s / 100) for s in range(start, start + 500)]
        out = [s.payload for s in [*summarised.poll().signals, *summarised.windows.flush()]]
        assert all(isinstance(p, ProgressSample) for p in out)
        ends = [p.step for p in out if isinstance(p, ProgressSample)]
        # Closed every 16 steps, long before the 5 s window's end: the service hears of each rank within 16 steps.
        assert ends[:-1] == list(range(16 * (start // 16 + 1), start + 499, 16)) and ends[-1] == start + 499
        listed.append({a[0] for p in out if isinstance(p, ProgressSample) for a in p.arrivals})
        assert listed[-1] == set(range(start, start + 500))  # every step, with its time
    assert len(listed[0] & listed[1]) == 494  # the steps both nodes ran, for the arrival lag


def test_a_window_of_repeated_step_numbers_lists_steps_on_a_grid_every_node_shares() -> None:
    # A window holds more steps than a summary lists only when its lines repeat step numbers (micro-steps
    # printing their optimizer step): thinned, every node keeps multiples of the same power of two.
    kept = [thin([(s, float(s), None) for s in range(start, start + 300)]) for start in (1, 7)]
    assert all(len(k) <= 64 for k in kept)
    shared = {a[0] for a in kept[0][:-1]} & {a[0] for a in kept[1][:-1]}
    assert shared == set(range(8, 300, 8)), sorted(shared)


def test_lines_the_service_must_read_go_as_lines_after_the_steps_before_them(steps: LineStep) -> None:
    src = _Lines()
    summarised = SummarisedProgress(src, 5.0, clock=lambda: 0.0, from_lines=steps)
    t = 1_700_000_000.0
    src.pending = [_line(1, MEGATRON.format(step=249_998, ms=900.0), 0, t),
                   _line(2, MEGATRON.format(step=249_999, ms=900.0), 0, t + 1),
                   _line(3, MEGATRON.format(step=250_000, ms=900.0), 0, t + 2),  # the last: it carries the total
                   _line(4, HF_TRAINER, 0, t + 3),                             # counted by the service
                   _line(5, OOM_AT_STEP, 1, t + 4),                            # a fault rule matches it
                   _line(6, "tokenizer vocab size 32000", 0, t + 5)]           # no progress at all
    out = summarised.poll().signals
    kinds = [("summary", s.payload.step) if isinstance(s.payload, ProgressSample) else ("line", s.id[-1])
             for s in out]
    assert kinds == [("summary", 249_999), ("line", "3"), ("line", "4"), ("line", "5"), ("line", "6")]



def test_the_agent_ships_summaries_of_its_pods_step_lines_and_every_line_with_summaries_off(tmp_path: Path) -> None:
    for rank in (0, 1):
        w = CriWriter(tmp_path / "pods", pod=f"llama-worker-{rank}", uid=f"u{rank}")
        for step in range(1, 41):
            w.line(MEGATRON.format(step=step, ms=1000.0))
    settings = _settings(tmp_path, progress_summary_s=0.01)
    agent = build_agent(settings)
    agent.run_once()
    agent.flush()
    agent.run_once()  # the window closed: its summaries go
    agent.flush()
    got = spooled(settings.state_dir)
    # Windows close every 16 steps and at the window's end: three summaries per rank.
    assert sorted((s["source"], s["payload"]["rank"], s["payload"]["step"], s["payload"].get("samples"))
                  for s in got) == [("progress", r, step, n) for r in (0, 1)
                                    for step, n in ((16, 16), (32, 16), (40, 8))]

    # Summaries off (progress_summary_s=0): every line, as older agents ship them (the service still reads them).
    off = _settings(tmp_path / "off", progress_summary_s=0, pods_root=tmp_path / "pods")
    plain = build_agent(off)
    plain.run_once()
    plain.flush()
    assert [s["source"] for s in spooled(off.state_dir)] == ["container"] * 80


def test_a_rank_that_exits_has_its_steps_sent_before_its_exit(steps: LineStep) -> None:
    from collector.progress_summary import ExitsAfterSteps

    lines, procs = _Lines(), _Lines()
    summarised = SummarisedProgress(lines, 5.0, clock=lambda: 0.0, from_lines=steps)
    exits = ExitsAfterSteps(procs, summarised.windows)
    t = 1_700_000_000.0
    lines.pending = [_line(s, MEGATRON.format(step=s, ms=10.0), 0, t + s / 100) for s in range(1, 61)]
    # A fast job: its windows closed at steps 16, 32 and 48; steps 49-60 are still in the open one.
    assert [s.payload.step for s in summarised.poll().signals if isinstance(s.payload, ProgressSample)] == [16, 32, 48]
    procs.pending = [Signal("gpu-3/process/llama/0/exit", "gpu-3", Source.CONTAINER, t + 1,
                            ProgressSample("llama", 0, 0, event="exit", namespace="train"))]
    out = exits.poll().signals
    assert [(s.payload.event, s.payload.step) for s in out if isinstance(s.payload, ProgressSample)] == [
        ("step", 60), ("exit", 0)]
