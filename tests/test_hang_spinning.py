"""A rank spinning on a CPU in a deadlock before its job's first progress line (``while not flag: pass``): a hang
naming it once its stack stayed the same for five minutes of looks while its peer waited in the all-reduce at every
look (was: only at `first_steps_timeout_s`, 600 s), from real ``py-spy dump`` output of a real gloo job whose rank 1
spun and rank 0 waited; and never a rank busy decoding data before its first step (real dumps of a real one: its
stack changes from look to look), nor a rank whose stack moved on."""

from __future__ import annotations

from pathlib import Path

from analyzer.detectors.stacks import StackSample
from analyzer.detectors.suite import DetectorSuite
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from analyzer.records import Finding

STACKS = Path(__file__).resolve().parent / "fixtures" / "stacks"
SPINNING = (STACKS / "spinning_rank1.txt").read_text()
"""Rank 1 of a 2-rank plain DDP job spinning at its first forward pass (the same at every look over 15 s)."""
SPIN_PEER = (STACKS / "spinning_peer_rank0.txt").read_text()
LOADING = [(STACKS / f"loading_rank0_look{k}.txt").read_text() for k in range(7)]
"""Rank 0 of the same job decoding records before its first step, looked at every 4 s."""
LOAD_PEER = (STACKS / "loading_peer_rank1.txt").read_text()
LOOK_S = 15.0
"""Looks come every half threshold while stacks hold a job that printed nothing yet (30 s threshold)."""


def _suite() -> DetectorSuite:
    suite = DetectorSuite()
    for r in range(2):
        suite.book.observe_progress(ProgressEvent(job="ddp", rank=r, node="gpu-node-00", ts=0.0,
                                                  kind=ProgressKind.START, step=None, namespace="train"))
    return suite


def _hangs(suite: DetectorSuite, looks: int, texts: list[tuple[str, str]], cpu_per_s: tuple[float, float],
           start: float = 15.0) -> list[tuple[float, Finding]]:
    """Look at both ranks every `LOOK_S` from `start` (`texts[k % len(texts)]`: rank 0's and rank 1's dump);
    (time, finding) of each hang finding."""
    found = []
    for k in range(looks):
        ts = start + LOOK_S * k
        for r in range(2):
            text = texts[k % len(texts)][r]
            suite.add_stack("train/ddp", StackSample(rank=r, node="gpu-node-00", pid=100 + r, text=text, state="S",
                                                     cpu_s=2.0 + cpu_per_s[r] * ts), ts + 0.01 * r)
        found += [(ts, f) for f in suite.evaluate(ts + 1.0) if f.fault_class.value == "hang"]
    return found


def test_a_rank_spinning_in_one_place_while_its_peer_waits_is_a_hang_naming_it_after_five_minutes() -> None:
    found = _hangs(_suite(), 24, [(SPIN_PEER, SPINNING)], (0.002, 0.7))
    assert found, "no hang"
    first = min(ts for ts, _ in found)
    # The first look at 15 s, the same stack 300 s later: called at the look at 315 s (was 600 s).
    assert 315.0 <= first <= 330.0, first
    named = [f for ts, f in found if f.rule_id == "hang-detector"]
    assert [(f.where.rank, f.where.node) for f in named] == [(1, "gpu-node-00")], found
    assert "rank 1 on gpu-node-00 spinning in _spin (sitecustomize.py:65)" in named[0].message, named[0].message
    assert "wait in _engine_run_backward" in named[0].message and "% of a CPU" in named[0].message


def test_a_rank_decoding_data_for_minutes_before_its_first_step_is_no_hang() -> None:
    # The real loading rank's dumps, in the order they were taken, over and over: it uses a CPU and its peer waits,
    # as with a spinning rank, but its stack is not the same from look to look.
    assert _hangs(_suite(), 20, [(d, LOAD_PEER) for d in LOADING], (0.6, 0.002)) == []


def test_a_rank_whose_stack_stays_only_for_a_while_or_whose_peer_does_not_wait_is_no_hang() -> None:
    # The same stack at six looks over 75 s, then elsewhere (the loop was left: what it waited for came), then the
    # same again: never five minutes in one place.
    texts = [(SPIN_PEER, SPINNING)] * 6 + [(SPIN_PEER, LOADING[1])]
    assert _hangs(_suite(), 14, texts, (0.002, 0.7)) == []
    # Its peer ran at one look in between (in its own code): the peer does not wait for it all along.
    texts = [(SPIN_PEER, SPINNING)] * 4 + [(LOADING[3], SPINNING)]
    assert _hangs(_suite(), 14, texts, (0.002, 0.7)) == []
