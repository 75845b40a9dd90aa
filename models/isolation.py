"""Node outliers: an IsolationForest over per-node features, on robustly standardised columns."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


class NodeOutlierModel:
    """Unsupervised outlier model over one row per node (estimator-shaped).

    Columns are centred on their median and scaled by their MAD before the forest
    sees them, so features in MHz, °C and bytes weigh alike and one broken column
    cannot dominate. ``predict`` gives +1 (inlier) / -1 (outlier); ``score_samples``
    is lower for more abnormal nodes.
    """

    def __init__(self, *, n_estimators: int = 100, contamination: float | str = "auto",
                 max_samples: int | str = "auto", random_state: int = 0) -> None:
        self.n_estimators = n_estimators
        self.contamination = contamination
        self.max_samples = max_samples
        self.random_state = random_state

    def _standardise(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        return (x - self.center_) / self.scale_

    def fit(self, x: NDArray[np.float64]) -> NodeOutlierModel:
        """Fit on a (nodes x features) matrix."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] < 2:
            raise ValueError("need a 2-D matrix with at least two rows")
        self.center_ = np.median(x, axis=0)
        mad = np.median(np.abs(x - self.center_), axis=0)
        self.scale_ = np.where(mad > 0, 1.4826 * mad, np.maximum(np.abs(self.center_) * 0.01, 1e-9))
        # Imported on first fit: scikit-learn takes about a second to import, and `kmend serve` must be
        # ready (and `kmend analyze` done) long before a straggler check first has enough ranks to fit.
        from sklearn.ensemble import IsolationForest

        self.forest_ = IsolationForest(n_estimators=self.n_estimators, contamination=self.contamination,
                                       max_samples=self.max_samples, random_state=self.random_state)
        self.forest_.fit(self._standardise(x))
        return self

    def score_samples(self, x: NDArray[np.float64]) -> NDArray[np.float64]:
        """Anomaly scores (lower = more abnormal), as IsolationForest.score_samples."""
        out: NDArray[np.float64] = self.forest_.score_samples(self._standardise(np.asarray(x, dtype=np.float64)))
        return out

    def predict(self, x: NDArray[np.float64]) -> NDArray[np.int64]:
        """+1 for inliers, -1 for outliers."""
        out: NDArray[np.int64] = self.forest_.predict(self._standardise(np.asarray(x, dtype=np.float64)))
        return out
