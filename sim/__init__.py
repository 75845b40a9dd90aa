"""The embedded default: a simulated cluster, training jobs and fault injection."""
