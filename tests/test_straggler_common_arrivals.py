"""The arrival-lag score's common steps (`common_arrivals`): the newest steps every rank reported, read from each
rank's newest entries when ranks are lock-stepped, and the same answer as intersecting every rank's steps otherwise."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from analyzer.detectors.arrivals import common_arrivals


def _reference(arrivals: list[deque[tuple[int, float]]], window: int) -> tuple[list[int], list[list[float]]]:
    seen = [dict(a) for a in arrivals]
    steps = sorted(set.intersection(*(set(d) for d in seen)))[-window:] if seen else []
    return steps, [[d[k] for k in steps] for d in seen]


def _rank(rng: random.Random, first: int, last: int, gaps: float) -> deque[tuple[int, float]]:
    out: deque[tuple[int, float]] = deque(maxlen=64)
    for step in range(first, last + 1):
        if step in (first, last) or rng.random() >= gaps:
            out.append((step, step * 0.85 + rng.uniform(0, 0.05)))
    return out


@pytest.mark.parametrize("gaps", [0.0, 0.02, 0.3])
def test_the_common_steps_are_those_every_rank_reported(gaps: float) -> None:
    rng = random.Random(11)
    for _ in range(300):
        ranks = rng.randint(1, 40)
        base = rng.randint(0, 200)
        arrivals = [_rank(rng, base + rng.randint(0, 3), base + rng.randint(5, 90), gaps) for _ in range(ranks)]
        window = rng.choice([4, 20, 64])
        steps, at = common_arrivals(arrivals, window)
        want_steps, want_at = _reference(arrivals, window)
        assert steps == want_steps
        assert at.shape == (ranks, len(want_steps))
        assert np.array_equal(at, np.array(want_at, dtype=np.float64).reshape(ranks, len(want_steps)))


def test_a_rank_ahead_of_the_others_gives_the_steps_up_to_the_slowest_ranks_newest() -> None:
    behind = deque(((s, s * 1.0) for s in range(10, 40)), maxlen=64)
    ahead = deque(((s, s * 1.0 + 0.2) for s in range(10, 43)), maxlen=64)
    steps, at = common_arrivals([behind, ahead], 20)
    assert steps == list(range(20, 40))
    assert list(at[1] - at[0]) == pytest.approx([0.2] * 20)


def test_no_rank_or_a_rank_with_no_steps_has_no_common_step() -> None:
    assert common_arrivals([], 20)[0] == []
    assert common_arrivals([deque([(1, 1.0)]), deque()], 20)[0] == []


def test_steps_read_since_an_earlier_answer_give_the_same_answer_as_reading_them_all() -> None:
    rng = random.Random(5)
    arrivals: list[deque[tuple[int, float]]] = [deque(maxlen=64) for _ in range(24)]
    prior: tuple[list[int], np.ndarray] | None = None
    for step in range(1, 150):
        for a in arrivals:  # every rank reports the step; some a few steps early, some jumping ahead
            while (not a or a[-1][0] < step + rng.choice([0, 0, 0, 1, 3])) and rng.random() > 0.05:
                a.append(((a[-1][0] if a else 0) + 1, step + rng.uniform(0, 0.05)))
        if not all(arrivals):
            continue
        got = common_arrivals(arrivals, 20, prior)
        want = common_arrivals(arrivals, 20)
        assert got[0] == want[0]
        assert np.array_equal(got[1], want[1])
        prior = got
