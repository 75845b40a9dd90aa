"""The arrival lag on a loaded node: a healthy rank whose log lines reached the runtime in one burst is not named
behind, while a rank whose own work is slow is still named through the same recorded noise.

The fixture is recorded (``bench/realjobs.py --jobs ddp --load 2 --evidence``): a healthy 4-rank plain DDP job, about
100 steps a second, beside two busy loops on the 2-core test machine at load 15-18; every rank's step lines as the
CRI files stamped them, steps 5240-5330. Rank 0's lines for steps 5275-5301 (27 steps, 0.10 s of its peers'
training) were all stamped at one instant, 0.14 s after its peers reported step 5275: its output waited in the pipe
while the reader was descheduled. Its peers reported steps 5276-5301 in that time, which a lock-stepped rank cannot
let them do. The live service named rank 0 a straggler at step 5296 (lag 0.105 s, step period 0.5 ms).
"""

from __future__ import annotations

import json
from pathlib import Path

from analyzer.detectors.suite import DetectorSuite
from analyzer.records import FaultClass, Finding
from collector.progress_summary import ProgressWindows
from collector.signal import ProgressSample, Signal, Source

RECORDED = Path(__file__).resolve().parent / "fixtures" / "arrivals" / "ddp4-beside-busy-loops.json"
T0 = 1_800_000_000.0
FLUSH_S = 0.2
"""The agent's flush interval in the real-job harness."""


def _recorded() -> dict[int, list[tuple[int, float]]]:
    raw = json.loads(RECORDED.read_text())
    return {int(r): [(int(s), T0 + float(t)) for s, t in steps] for r, steps in raw.items()}


def _stragglers(arrivals: dict[int, list[tuple[int, float]]]) -> list[Finding]:
    """The step lines through the agent's windows (closed every 16 steps, flushed every 0.2 s) and the service's
    detectors, judged at every flush."""
    windows, suite = ProgressWindows(), DetectorSuite()
    lines = sorted((t, r, s) for r, steps in arrivals.items() for s, t in steps)
    found: list[Finding] = []
    batch: list[Signal] = []
    flush_at = lines[0][0] + FLUSH_S

    def judge(now: float) -> None:
        nonlocal batch
        suite.observe(batch + windows.flush(now))
        found.extend(f for f in suite.evaluate(now) if f.fault_class is FaultClass.STRAGGLER)
        batch = []

    for t, r, s in lines:
        while t >= flush_at:
            judge(flush_at)
            flush_at += FLUSH_S
        sig = Signal(f"node-0/cri/{r}/{s}", "node-0", Source.CONTAINER, t,
                     ProgressSample("ddp", r, s, None, namespace="train"))
        batch += windows.add(sig, arrival=True)
    judge(flush_at)
    return found


def test_a_healthy_ranks_burst_of_late_lines_names_nobody() -> None:
    assert [(f.where.rank, f.fields) for f in _stragglers(_recorded())] == []


def test_a_rank_slow_after_each_step_is_named_through_the_same_recorded_noise() -> None:
    # From step 5260 rank 2's work after each all-reduce takes 0.15 s longer: it reports each step 0.15 s late, and
    # its peers report the next step only after waiting for it in that step's all-reduce.
    onset, slow = 5260, 0.15
    recorded = _recorded()
    shifted = {r: [(s, t + slow * max(0, s - onset + (1 if r == 2 else 0))) for s, t in steps]
               for r, steps in recorded.items()}
    found = _stragglers(shifted)
    assert {f.where.rank for f in found} == {2}, [(f.where.rank, f.fields) for f in found]
    f = found[0]  # (rank 0's burst of late lines makes the median rank later for a while: a second episode may open)
    assert f.fields["basis"] == "arrival_lag" and int(f.fields["step"]) - onset <= 30, f.fields
    assert 0.12 < float(f.fields["lag_s"]) < 0.18, f.fields
