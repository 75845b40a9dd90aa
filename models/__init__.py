"""Anomaly-detection models (scikit-learn / pandas), estimator-shaped."""
