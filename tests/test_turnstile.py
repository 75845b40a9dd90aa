"""The ingest turnstile: batches get their turn in arrival order, and the wait a new batch faces is told ahead."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kmend.turnstile import Turnstile


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_turns_are_taken_in_arrival_order_and_the_wait_is_estimated() -> None:
    clock = Clock()
    gate = Turnstile(clock)
    assert gate.expected_wait() == 0.0
    order: list[int] = []

    def batch(i: int) -> None:
        with gate.turn():
            order.append(i)

    threads = []
    with gate.turn():
        for i in range(6):  # each asks once the one before it is queued
            t = threading.Thread(target=batch, args=(i,))
            t.start()
            threads.append(t)
            _wait_for(lambda n=i + 2: gate.queued == n)  # type: ignore[misc]
        clock.now = 3.0
        assert gate.expected_wait() == 3.0  # the turn under way has lasted 3 s; no mean turn known yet
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3, 4, 5]
    assert gate.queued == 0 and gate.expected_wait() == 0.0
    assert 0 < gate.turn_s <= 3.0
    with gate.turn():  # one turn under way, two waiting: the new one waits for all three
        waiting = [threading.Thread(target=batch, args=(i,)) for i in (6, 7)]
        for i, t in enumerate(waiting):
            t.start()
            _wait_for(lambda n=i + 2: gate.queued == n)  # type: ignore[misc]
        assert gate.expected_wait() == 3 * gate.turn_s
    for t in waiting:
        t.join(10)
    assert order[-2:] == [6, 7]
