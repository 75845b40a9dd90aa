"""Where the shipped rule packs are: imported by settings without loading the rule engines (their imports and compiled
patterns are a fifth of a second that `kmend serve` need not spend before it starts the gang scheduler)."""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent / "rules"


def default_rules_dir() -> Path:
    """The shipped rule packs (``rules/`` at the project root)."""
    return _ROOT


def default_metric_rules_dir() -> Path:
    """The shipped metric and alert packs (``rules/metrics/``)."""
    return _ROOT / "metrics"


def default_progress_rules_dir() -> Path:
    """The shipped progress packs (``rules/progress/``)."""
    return _ROOT / "progress"
