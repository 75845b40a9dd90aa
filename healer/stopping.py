"""An operator's stop of a plan whose steps run in another thread: decided and journaled at once, honoured between
steps.

A runbook call (reject a plan, release its node) used to wait for the plan's step in flight to end (a drain's
evictions, a checkpoint restore: seconds to a minute) before it could journal its decision. With a ``Stop`` the call
journals the decision between two of the run's journal writes (``decide``) and answers; the run sees it before its
next step (and the drain before its next eviction: ``stop_asked``), journals the result of the step in flight and
ends. Neither overwrites the other: the run's writes and the decision take the same lock, which is never held across
a request to the cluster.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from healer.records import Plan, StepKind


class Stop:
    """The operator's hold on one run of a plan."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Held across each journal write of the run and across the operator's decision, never across cluster I/O."""
        self.decided: Plan | None = None
        """The plan as the operator's decision journaled it (rejected, cancelled); None while the run goes on."""
        self.step: StepKind | None = None
        """The kind of the step the run has in flight (None between steps)."""
        self._changed = threading.Condition(self.lock)

    def decide(self, decision: Callable[[], Plan | None]) -> Plan | None:
        """Run ``decision`` (read the journal, check the plan's state, save the decision) between two journal writes
        of the run. A plan it returns stops the run before its next step."""
        with self.lock:
            plan = decision()
            if plan is not None:
                self.decided = plan
                self._changed.notify_all()
            return plan

    def in_flight(self, kind: StepKind | None) -> None:
        """The run starts a step of ``kind`` (None: the step's result is journaled). Called under ``lock``."""
        self.step = kind
        self._changed.notify_all()

    def wait_out(self, kinds: Collection[StepKind], timeout: float) -> bool:
        """Wait until the run has no step of ``kinds`` in flight; False when ``timeout`` passed first."""
        with self.lock:
            return self._changed.wait_for(lambda: self.step not in kinds, timeout)


_CURRENT: ContextVar[Stop | None] = ContextVar("kmend_plan_stop", default=None)


@contextmanager
def running(stop: Stop) -> Iterator[None]:
    """The run in this thread is ``stop``'s (``stop_asked`` reads it)."""
    token = _CURRENT.set(stop)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def stop_asked() -> bool:
    """Whether an operator stopped the plan whose step runs in this thread: a step with several requests to make (a
    drain's evictions) asks before each one and leaves the rest."""
    stop = _CURRENT.get()
    return stop is not None and stop.decided is not None
