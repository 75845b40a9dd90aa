"""The arrival-lag score's data: the steps every rank of a job reported and when, and one window's lag per rank.

Pure numpy over each rank's (step, arrival time) entries; the straggler detector decides what a lag means.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import islice

import numpy as np


def common_arrivals(arrivals: Sequence[deque[tuple[int, float]]], window: int,
                    prior: tuple[list[int], np.ndarray] | None = None) -> tuple[list[int], np.ndarray]:
    """The newest `window` steps every rank reported (oldest first), and when each rank reported each (a row a rank).

    Each rank's arrivals are in rising step order. Lock-stepped ranks hold the same run of consecutive steps, a
    rank at most a few steps ahead: then the common steps are the run up to the lowest rank's newest step, read
    from each rank's newest entries without a set or dict per rank (a 512-rank job's score was most of an
    evaluation). Otherwise, the steps every rank holds are intersected. `prior`: this function's answer for the
    same ranks earlier; a step's arrival time never changes, so only the steps since are read.
    """
    if not arrivals or not all(arrivals):
        return [], np.empty((len(arrivals), 0))
    upper = min(a[-1][0] for a in arrivals)
    # Entries above `upper`, when each rank's steps past it are consecutive; checked below.
    extra = [a[-1][0] - upper for a in arrivals]
    w = min(window, min(len(a) - x for a, x in zip(arrivals, extra, strict=True)))
    if w > 0 and all(a[len(a) - x - 1][0] == upper and a[len(a) - x - w][0] == upper - w + 1
                     for a, x in zip(arrivals, extra, strict=True)):
        # Rising whole steps: w entries from upper - w + 1 to upper are every step between, on every rank.
        lo = upper - w + 1
        if prior is not None and prior[0] and prior[0][-1] - prior[0][0] == len(prior[0]) - 1 \
                and prior[0][0] <= lo and lo - 1 <= prior[0][-1] <= upper:
            d = upper - prior[0][-1]  # steps since: read from each rank's entries below its `extra`
            new = [[t for _, t in islice(a, len(a) - x - d, len(a) - x)] for a, x in zip(arrivals, extra, strict=True)]
            at = np.hstack([prior[1][:, lo - prior[0][0]:], np.array(new, dtype=np.float64).reshape(len(arrivals), d)])
            return list(range(lo, upper + 1)), at
        rows = [[t for _, t in islice(a, len(a) - x - w, len(a) - x)] for a, x in zip(arrivals, extra, strict=True)]
        return list(range(upper - w + 1, upper + 1)), np.array(rows, dtype=np.float64)
    seen = [dict(a) for a in arrivals]
    steps = sorted(set.intersection(*(set(d) for d in seen)))[-window:]
    return steps, np.array([[d[k] for k in steps] for d in seen], dtype=np.float64).reshape(len(seen), len(steps))


def lag_window(at: np.ndarray, lag: np.ndarray, common: list[int], j: int, *, window: int, lag_min_s: float,
               lag_fraction: float) -> tuple[np.ndarray, float, float, int]:
    """The window of up to `window` common steps ending at index `j`: each rank's median lag behind the first
    rank to report a step, over the ranks' median lag; the job's step period; the lag a late rank must reach.

    A step's lag counts only up to the time the first rank took to report the next step. Lock-stepped ranks cannot
    be further apart than that: the next step's all-reduce waits for the late rank, so its peers report the next
    step only after it reported this one. A line stamped later than its peers' next step was held on its way to the
    log (the pipe, the runtime's reader descheduled on a loaded node, which then stamps a burst of lines at once),
    not by the rank's work: a healthy rank of a DDP job stepping every 9 ms, 27 of whose lines were stamped at one
    instant, was named 0.105 s behind. The newest step, with no next one yet, counts whole.
    """
    lo = max(0, j + 1 - window)
    first = at[:, lo:j + 1].min(axis=0)
    gaps = np.diff(first)
    own = lag[:, lo:j + 1].copy()
    own[:, :-1] = np.minimum(own[:, :-1], gaps)
    med = np.median(own, axis=1)
    period = float(np.median(gaps / np.diff(np.array(common[lo:j + 1], dtype=np.float64))))
    return med - float(np.median(med)), period, max(lag_min_s, lag_fraction * period), j + 1 - lo
