"""Robust outlier scores: median/MAD z-scores and the relative slowdown against the median."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

MAD_TO_SIGMA = 1.4826
"""Scales the median absolute deviation to a standard deviation for normal data."""


class RobustScorer:
    """Scores values against the population's median; estimator-shaped (fit, then score).

    ``score`` is the robust z-score (how many robust sigmas above the median);
    ``ratio`` is value / median, i.e. the slowdown factor when values are times.
    """

    def __init__(self, *, rel_floor: float = 0.01) -> None:
        self.rel_floor = rel_floor

    def fit(self, x: NDArray[np.float64]) -> RobustScorer:
        """Learn the centre (median) and scale (MAD, floored at rel_floor x median)."""
        x = np.asarray(x, dtype=np.float64)
        if x.size == 0:
            raise ValueError("cannot fit on no values")
        self.center_ = float(np.median(x))
        mad = float(np.median(np.abs(x - self.center_)))
        # Identical values (or a tiny population) would give a zero scale and infinite scores.
        self.scale_ = max(MAD_TO_SIGMA * mad, self.rel_floor * abs(self.center_), 1e-12)
        return self

    def score(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """Robust z-scores (positive: above the median)."""
        return (np.asarray(x, dtype=np.float64) - self.center_) / self.scale_

    def ratio(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """Each value divided by the median."""
        return np.asarray(x, dtype=np.float64) / self.center_ if self.center_ else np.ones_like(x)
