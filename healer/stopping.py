"""An operator's stop of a plan whose steps run in another thread: decided and journaled at once, honoured between
steps.

A runbook call (reject a plan, release its node) used to wait for the plan's step in flight to end (a drain's
evictions, a checkpoint restore: seconds to a minute) before it could journal its decision. With a ``Stop`` the call
journals the decision between two of the run's journal writes (``decide``) and answers; the run sees it before its
next step (and the drain before its next eviction: ``stop_asked``), journals the result of the step in flight and
ends. Neither overwrites the other: the run's writes and the decision take the same lock, which is never held across
a request to the cluster.

An agent's answer written into one of the run's steps (a GPU report kept with the evidence) goes through the same lock
(``amend``): the run's later saves carry it, so a whole-plan save never writes back the step as the run read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace

from healer.deciding import ended
from healer.records import ActionStep, Plan, StepKind

Closing = Callable[[ActionStep, Plan], ActionStep]
"""How the step in flight ends once the run journals it, in a plan an operator decided meanwhile (``ended``, and the
service also withdraws the step's open requests)."""


class Stop:
    """The operator's hold on one run of a plan."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Held across each journal write of the run and across the operator's decision, never across cluster I/O."""
        self.decided: Plan | None = None
        """The plan as the operator's decision journaled it (rejected, cancelled); None while the run goes on."""
        self.step: StepKind | None = None
        """The kind of the step the run has in flight (None between steps)."""
        self.amended: dict[str, dict[str, str]] = {}
        """Outputs written into the run's steps from outside the run (an agent's report), by step id: every later save
        of the run carries them."""
        self.closing: Closing = ended
        """How the step in flight ends when the run journals it after the decision."""
        self._changed = threading.Condition(self.lock)

    def decide(self, decision: Callable[[], Plan | None], closing: Closing | None = None) -> Plan | None:
        """Run ``decision`` (read the journal, check the plan's state, save the decision) between two journal writes
        of the run. A plan it returns stops the run before its next step; the step in flight ends by ``closing``."""
        with self.lock:
            plan = decision()
            if plan is not None:
                self.decided = plan
                self.closing = closing or ended
                self._changed.notify_all()
            return plan

    def amend(self, save: Callable[[], tuple[str, Mapping[str, str]] | None]) -> None:
        """Run ``save`` (journal outputs into one of the plan's steps; it returns the step's id and those outputs)
        between two journal writes of the run, which keeps them in its later saves."""
        with self.lock:
            if (saved := save()) is not None:
                self.amended.setdefault(saved[0], {}).update(saved[1])

    def merged(self, step: ActionStep) -> ActionStep:
        """The step with the outputs amended from outside the run. Called under ``lock``."""
        extra = self.amended.get(step.id)
        return replace(step, outputs={**step.outputs, **extra}) if extra else step

    def merged_plan(self, plan: Plan) -> Plan:
        """The plan with every step's amended outputs. Called under ``lock``."""
        return replace(plan, steps=tuple(map(self.merged, plan.steps))) if self.amended else plan

    def heard(self, plan: Plan, closing: Closing) -> None:
        """The operator's decision as another replica journaled it: the run stops as after ``decide``. Called under
        ``lock``."""
        self.decided, self.closing = plan, closing
        self._changed.notify_all()

    def closed(self, step: ActionStep) -> ActionStep:
        """The step as the run journals it: ended when an operator decided the plan meanwhile. Called under ``lock``."""
        return step if self.decided is None else self.closing(step, self.decided)

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
