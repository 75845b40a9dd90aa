"""Reservations: capacity held for a restarting gang so that no other gang takes its slots."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Reservation:
    """Nodes held for one restarting gang."""

    gang: str
    """Gang key, ``namespace/group``."""
    nodes: frozenset[str]
    """Nodes the gang ran on that stay healthy; only this gang may use them while held."""
    failed: frozenset[str] = frozenset()
    """Nodes being replaced; the gang may use a spare (or free node) for each."""
    until: float = float("inf")
    """When the hold lapses if the gang has not been placed by then."""


class ReservationBook:
    """The reservations in force; the healer writes them, the scheduler reads and clears them."""

    def __init__(self) -> None:
        self._held: dict[str, Reservation] = {}

    def hold(self, gang: str, nodes: Iterable[str], *, failed: Iterable[str] = (),
             until: float = float("inf")) -> Reservation:
        """Hold ``nodes`` for ``gang`` (replacing any earlier hold) and note the failed nodes."""
        failed_set = frozenset(failed)
        reservation = Reservation(gang, frozenset(nodes) - failed_set, failed_set, until)
        self._held[gang] = reservation
        return reservation

    def release(self, gang: str) -> None:
        """Drop the hold (the gang is placed, or the job is gone)."""
        self._held.pop(gang, None)

    def active(self, now: float) -> tuple[Reservation, ...]:
        """Holds still in force at ``now``; lapsed ones are dropped."""
        for gang in [g for g, r in self._held.items() if r.until <= now]:
            del self._held[gang]
        return tuple(self._held.values())

    def get(self, gang: str) -> Reservation | None:
        """The hold for ``gang``, if any."""
        return self._held.get(gang)
