"""Batches analysed in the order they arrived, and refused early when the queue ahead is too long.

The service lock (`threading.RLock`) is not fair: a batch that has just been decoded can take it before one
that has waited for seconds, so with a few busy agents some batches wait several times the mean. Batches
pass this turnstile one at a time in arrival order instead, so a batch waits for the batches ahead of it
and no more, and how long that is can be told before a batch is decoded: a batch that would wait longer
than the budget is answered "busy, retry later" at once (the agent keeps it and sends it again), instead
of holding its agent's connection while the queue grows.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EWMA = 0.2
"""Weight of the newest turn in the running mean of a turn's length."""


class Turnstile:
    """A fair (first come, first served) gate with an estimate of the wait it would impose."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._mutex = threading.Lock()
        self._waiting: deque[threading.Lock] = deque()
        self._busy = False
        self._since = 0.0  # when the current turn began
        self.turn_s = 0.0
        """Running mean of a turn's length (seconds)."""

    @property
    def queued(self) -> int:
        """Callers holding or waiting for a turn."""
        with self._mutex:
            return len(self._waiting) + self._busy

    def expected_wait(self) -> float:
        """Seconds a caller arriving now would wait for its turn (0 when no one holds one)."""
        with self._mutex:
            if not self._busy:
                return 0.0
            held = self._clock() - self._since
            return max(held, self.turn_s) + len(self._waiting) * self.turn_s

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold a turn: callers get theirs in the order they asked."""
        with self._mutex:
            if self._busy:
                gate = threading.Lock()
                gate.acquire()
                self._waiting.append(gate)
            else:
                gate = None
                self._busy = True
                self._since = self._clock()
        if gate is not None:
            gate.acquire()  # released by the turn before it, which hands its turn on (`_busy` stays set)
        try:
            yield
        finally:
            with self._mutex:
                now = self._clock()
                took = now - self._since
                self.turn_s = took if self.turn_s == 0.0 else (1 - EWMA) * self.turn_s + EWMA * took
                self._since = now
                if self._waiting:
                    self._waiting.popleft().release()
                else:
                    self._busy = False
