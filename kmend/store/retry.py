"""Retrying a batch's transaction on a transient database error, with its analysis run only once.

The correlator's state is in memory and cannot be rolled back with the transaction, so a
retried transaction reuses the first attempt's analysis instead of analysing again (which
would fold the same findings twice). Only when the batch itself changed between attempts
(another writer stored some of its signals meanwhile) is the analysis unusable; that is
reported as ``StaleAnalysis`` and the caller rebuilds its state from the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, OperationalError
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from analyzer.records import Finding, Incident
from collector.signal import Signal

T = TypeVar("T")
Results = tuple[list[Finding], list[Incident], list[tuple[str, str]]]

ATTEMPTS = 4
"""Tries per batch: a dropped connection, a failover or a serialization conflict clears within these."""


class StaleAnalysis(RuntimeError):
    """A retried transaction saw a different batch than the one already analysed."""


def is_transient(exc: BaseException) -> bool:
    """Errors the database raises for a moment: lost connection, lock or serialization conflict, failover."""
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def retrying(attempt: Callable[[], T], sleep: Callable[[float], None], attempts: int = ATTEMPTS) -> T:
    """``attempt()``, tried again after a transient database error (exponential back-off, at most ~1 s)."""
    for run in Retrying(retry=retry_if_exception(is_transient), stop=stop_after_attempt(attempts),
                        wait=wait_exponential(multiplier=0.05, max=1.0), sleep=sleep, reraise=True):
        with run:
            return attempt()
    raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover


class AnalyseOnce:
    """Wraps a batch analysis so retried transactions reuse the first result."""

    def __init__(self, analyse: Callable[[Sequence[Signal]], Results]) -> None:
        self._analyse = analyse
        self._done: tuple[tuple[str, ...], Results] | None = None

    def __call__(self, signals: Sequence[Signal]) -> Results:
        key = tuple(s.id for s in signals)
        if self._done is None:
            self._done = (key, self._analyse(signals))
        elif self._done[0] != key:
            raise StaleAnalysis("the batch changed between attempts of its transaction")
        return self._done[1]


class EvaluateOnce:
    """Like AnalyseOnce for a detector evaluation, which takes no batch."""

    def __init__(self, evaluate: Callable[[], Results]) -> None:
        self._evaluate = evaluate
        self._done: Results | None = None

    def __call__(self) -> Results:
        if self._done is None:
            self._done = self._evaluate()
        return self._done
