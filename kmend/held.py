"""Plans the hourly rate limit holds back: while its budget stays spent, a healer round neither reads nor asks them."""

from __future__ import annotations

from collections.abc import Sequence

from healer.records import Plan, PlanState, StepState, has_disrupted
from healer.safety import UNLIMITED_PREFIXES, Guard
from kmend.store import Store


def _states(plan: Plan) -> tuple[StepState, ...]:
    return tuple(s.state for s in plan.steps)


class RateHeld:
    """Running plans that had taken nothing away and made no progress when last asked, with their steps' states then.

    Only a plan's first step that takes capacity or work away is held back by the rate limit
    (``healer.safety.Guard``), so the guard's one count of such plans in the last hour answers for all of them.
    """

    def __init__(self, store: Store, guard: Guard) -> None:
        self.store = store
        self.guard = guard
        self._held: dict[str, tuple[StepState, ...]] = {}

    def note(self, before: Plan, done: Plan) -> None:
        """After a plan was asked: held if it is still running, has taken nothing away and went nowhere."""
        if done.state is PlanState.RUNNING and done.node and not has_disrupted(done.steps) \
                and not done.policy.startswith(UNLIMITED_PREFIXES) and _states(done) == _states(before):
            self._held[done.id] = _states(done)
        else:
            self._held.pop(done.id, None)

    def forget(self, plan_id: str) -> None:
        """The plan ran or changed otherwise: it is asked again."""
        self._held.pop(plan_id, None)

    def resync(self, runnable: Sequence[str]) -> None:
        """Keep only the held plans still runnable and unchanged in the journal (another replica's API may have
        moved one on): one read for all of them."""
        found = self.store.get_plans([pid for pid in runnable if pid in self._held]) if self._held else []
        self._held = {p.id: _states(p) for p in found
                      if p.state is PlanState.RUNNING and _states(p) == self._held[p.id]}

    def due(self, due: list[str], now: float) -> list[str]:
        """The due plans to ask: less the held ones while the last hour's budget is spent (one count)."""
        if not any(pid in self._held for pid in due) or self.guard.budget_spent(now) is None:
            return due
        return [pid for pid in due if pid not in self._held]
