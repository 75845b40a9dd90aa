"""Waiting for a condition that a background loop or another process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(what: str, pred: Callable[[], Any], timeout: float = 60.0) -> Any:
    """`pred()`'s first truthy value, polled every 10 ms; fails naming `what` after `timeout` seconds.

    The timeout is generous for a loaded machine: the wait returns as soon as the condition holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
