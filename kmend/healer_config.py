"""How the healer loop behaves: the settings the composition root hands the service."""

from __future__ import annotations

from dataclasses import dataclass, field

from healer.policy import PolicyConfig
from kmend.store.retention import Retention


@dataclass(frozen=True, slots=True)
class HealerConfig:
    """How the healer loop behaves."""

    policy: PolicyConfig
    """Global switches (dry-run, approval)."""
    symptom_settle_s: float = 30.0
    """Seconds to wait for a cause before acting on a symptom-only incident."""
    interval_s: float = 0.5
    """Loop period when nothing wakes it."""
    detector_interval_s: float = 1.0
    """How often the detectors (hang, straggler, Flight Recorder) are evaluated."""
    resume_s: float = 1.0
    """How often a plan whose step waits (pods terminating, a repair) is asked again."""
    quiet_resolve_s: float = 21600.0
    """An open incident with no new finding for this long resolves on its own (0: never)."""
    retention: Retention = field(default_factory=Retention)
    """How long each table keeps its rows."""
    retention_interval_s: float = 600.0
    """How often rows past their retention are deleted (``kmend.pruning``, a thread of its own)."""
    retention_share: float = 0.25
    """The largest share of the wall time a prune's transactions take (a backlog goes in paced passes)."""
    retention_pass_s: float = 5.0
    """The longest pruning pass; a backlog left after it goes on after `retention_rest_s`."""
    retention_rest_s: float = 1.0
    """The wait between two passes of a backlog."""
