"""The own-time score's data: each rank's newest own-time samples, kept as the book adds them.

An evaluation used to copy every rank's whole sample history (up to the book's window, 64 by default) into lists to
take its newest `window`; a 2,048-rank job's score read 131,000 samples a second where 2,048 were new. Here each rank's
newest `window` samples sit in one row of a ring (a numpy array), and an evaluation reads from the book only the
samples added since it last looked (``RankState.samples``); a rank whose samples the book dropped or replaced
(``RankState.edits``: its phases began, the hook's report took the place of a log line's) is read again, as is a rank
kept under a new state (a job merged into its namespaced one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from analyzer.detectors.book import RankState


@dataclass(slots=True)
class _Seen:
    """What one rank's row holds."""

    state: RankState
    """The rank's state it was read from."""
    samples: int
    """The state's ``samples`` when last read."""
    edits: int
    """The state's ``edits`` when last read."""
    row: int
    """Its row in the ring."""
    pos: int = 0
    """The column its next sample goes in."""
    held: int = 0
    """Samples it holds (up to the window, and no more than the state's `times` holds)."""


class OwnWindows:
    """One job's ranks' newest `window` own-time samples, updated from the samples added since the last read."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._seen: dict[int, _Seen] = {}
        """Per rank: what its row holds."""
        self._vals = np.zeros((0, window), dtype=np.float64)
        """The rings, a row a rank."""
        self.read = 0
        """Samples read from the book so far (what keeping the windows costs)."""

    def update(self, ranks: Sequence[tuple[int, RankState]]) -> None:
        """Take in the samples each rank's state added since the last update."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        window = self.window
        for rank, st in ranks:
            seen = self._seen.get(rank)
            if seen is None:
                seen = self._seen[rank] = _Seen(st, 0, st.edits, self._grow())
                new = len(st.times)
            elif seen.state is not st or seen.edits != st.edits:
                seen.state, seen.edits, seen.pos, seen.held = st, st.edits, 0, 0
                new = len(st.times)
            elif (new := st.samples - seen.samples) == 1:  # the common case: one step since the last score
                seen.samples = st.samples
                rows.append(seen.row)
                cols.append(seen.pos)
                vals.append(st.times[-1])
                seen.pos = (seen.pos + 1) % window
                seen.held = min(seen.held + 1, window, len(st.times))
                self.read += 1
                continue
            seen.samples = st.samples
            new = min(new, len(st.times), window)
            if new <= 0:
                continue
            taken = list(islice(reversed(st.times), new))
            taken.reverse()
            self.read += new
            rows += [seen.row] * new
            cols += [(seen.pos + k) % window for k in range(new)]
            vals += taken
            seen.pos = (seen.pos + new) % window
            seen.held = min(seen.held + new, window, len(st.times))
        if rows:
            self._vals[rows, cols] = vals

    def newest(self, ranks: Sequence[int]) -> np.ndarray:
        """The newest samples that every one of the ranks holds (up to the window), oldest first: a row a rank."""
        seen = [self._seen[r] for r in ranks]
        m = min((s.held for s in seen), default=0)
        at = np.array([s.row for s in seen], dtype=np.int64)
        pos = np.array([s.pos for s in seen], dtype=np.int64)
        cols = (pos[:, None] - m + np.arange(m)) % self.window
        out: np.ndarray = self._vals[at[:, None], cols]
        return out

    def _grow(self) -> int:
        """A row for a new rank (the array doubled when full)."""
        row = len(self._seen)
        if row == len(self._vals):
            self._vals = np.vstack([self._vals, np.zeros((max(8, row), self.window), dtype=np.float64)])
        return row
