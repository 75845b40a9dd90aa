"""What every source hands the agent: signals plus the read positions they complete."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

Cursor = Any
"""A JSON-ready read position (offset, sequence number...); ``None`` deletes the key."""

Clock = Callable[[], float]
"""Wall clock in seconds since the Unix epoch (injected so tests control time)."""


@dataclass(frozen=True, slots=True)
class Poll:
    """The result of one poll of one source."""

    signals: list[Any] = field(default_factory=list)
    """Signals read in this poll, in read order."""
    cursors: Mapping[str, Cursor] = field(default_factory=dict)
    """Positions to checkpoint once these signals (and all earlier ones) are delivered."""
    lines: int = 0
    """Raw lines or samples read, including those a prefilter dropped (for metrics)."""
    lost: int = 0
    """Records the source knows were lost before it could read them (kmsg overruns)."""
    errors: int = 0
    """Failures inside the source it recovered from (one bad file among many)."""
    filtered: int = 0
    """Lines the prefilter dropped because no rule could match them (counted, so an operator can see
    when a trainer's progress lines never reach the service)."""


class SignalSource(Protocol):
    """A node-side source of signals.

    Guarantees: ``poll`` returns promptly (it never waits for data), reads a
    bounded amount per call, and never re-emits a signal id it has already
    returned in this process unless it was restarted from a checkpoint. Its
    cursors are safe to persist once every signal it has returned so far has
    been shipped or spooled; a source resumed from them loses nothing.
    Errors are raised to the agent, which counts them and keeps polling.
    """

    name: str
    """Source name, also the checkpoint section and metrics label."""

    def poll(self) -> Poll:
        """Read what is new since the previous call."""
        ...

    def close(self) -> None:
        """Release files and handles; the source is not polled again."""
        ...


class LinePrefilter(Protocol):
    """Decides which log lines are worth shipping (a superset of what rules match).

    Guarantees: never drops a line that any rule pattern matches; ``scan`` on a
    buffer reports every line of it that ``matches`` would accept.
    """

    def matches(self, text: str) -> bool:
        """Whether one line is a candidate."""
        ...

    def scan(self, buf: bytes) -> list[int]:
        """Sorted end offsets of matches in a buffer of newline-separated lines."""
        ...
