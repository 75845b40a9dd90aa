"""Reachability of the API server and the backoff of the loops that call it.

Every loop that talks to the API server (the gang scheduler's cycles, the healer's rounds, the list/watch caches)
used to log each failed call and try again on its own short period: an API server that was down for a minute gave
thousands of warnings and a request every few tenths of a second from each loop. Here the loops share one
``Reachability`` per server, which says once that the server stopped answering (naming it and the error), then
at most once per doubling interval that it still does not, and once that it answers again; each loop waits on its
own ``Backoff`` (exponential, full jitter, capped so that the return is seen within seconds) and honours a
``Retry-After`` the server sent. Errors that are not the server's availability (a 403, a 422) are said once per loop
while they repeat unchanged (``Repeats``), never silenced.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from healer.cluster import ClusterError, TemporaryError

log = logging.getLogger(__name__)

FIRST_S = 0.1
"""First wait after a failure."""
CAP_S = 5.0
"""Longest wait: the server's return is noticed within this."""
STILL_FIRST_S = 5.0
"""The first "still unreachable" comes this long after the first warning; each next one after twice as long."""


class Backoff:
    """Exponential backoff with full jitter, capped: the n-th wait after a success is uniform in
    ``[0.5, 1] * min(cap_s, first_s * 2**n)``, and never shorter than what the server asked for (``Retry-After``)."""

    def __init__(self, *, first_s: float = FIRST_S, cap_s: float = CAP_S, rng: random.Random | None = None) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.rng = rng or random.Random()
        self.failures = 0
        """Failures since the last success."""

    def next(self, at_least: float = 0.0) -> float:
        """The wait before the next try (one more failure counted); ``at_least``: the server's ``Retry-After``."""
        ceiling = min(self.cap_s, self.first_s * 2 ** min(self.failures, 30))
        self.failures += 1
        return float(min(self.cap_s, max(at_least, ceiling * self.rng.uniform(0.5, 1.0))))

    def reset(self) -> None:
        """A call succeeded: the next failure waits ``first_s`` again."""
        self.failures = 0


class Reachability:
    """Whether one API server answers, as every loop calling it sees it; says so in the log once per change."""

    def __init__(self, server: str, *, clock: Callable[[], float] = time.monotonic,
                 still_first_s: float = STILL_FIRST_S) -> None:
        self.server = server
        self.clock = clock
        self.still_first_s = still_first_s
        self._lock = threading.Lock()
        self._since: float | None = None
        self._next_still = 0.0
        self._still_every = still_first_s
        self.outages = 0
        """Times the server stopped answering."""
        self.on_return: list[Callable[[], None]] = []
        """Called (from the thread whose call got the answer) when the server answers again after an outage: the
        loops backing off try at once instead of at the end of their wait."""

    @property
    def down(self) -> bool:
        """The last call failed for the server's availability and none has succeeded since."""
        return self._since is not None

    def failed(self, error: object) -> None:
        """A call failed because the server did not answer (refused, reset, timed out) or answered 5xx/429."""
        now = self.clock()
        with self._lock:
            if self._since is None:
                self._since = now
                self._still_every = self.still_first_s
                self._next_still = now + self._still_every
                self.outages += 1
                log.warning("API server %s unreachable: %s", self.server, _short(error))
            elif now >= self._next_still:
                self._still_every *= 2
                self._next_still = now + self._still_every
                log.warning("API server %s still unreachable after %.0f s: %s", self.server, now - self._since,
                            _short(error))

    def answered(self) -> None:
        """A call got an answer (one that is not a 5xx/429)."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            log.info("API server %s answers again after %.1f s", self.server, self.clock() - self._since)
            self._since = None
        for call in list(self.on_return):
            call()


def unreachable(exc: BaseException) -> bool:
    """The cluster port's error for a call the API server's availability failed (no answer, 5xx, 429)."""
    return isinstance(exc, TemporaryError) and exc.unreachable


def report(exc: Exception, what: str, reach: Reachability | None, repeats: Repeats, to: logging.Logger) -> None:
    """Say why a loop's round failed: an API server that does not answer once for all loops (``reach``), another
    error of the cluster (a 403) once while it repeats unchanged, anything else (a bug) with its traceback."""
    if reach is not None and unreachable(exc):
        reach.failed(exc)
    elif isinstance(exc, ClusterError):
        if repeats.new(exc):
            to.warning("%s: %s", what, exc)
    else:
        to.error("%s", what, exc_info=exc)


def outage_wait(reach: Reachability | None, backoff: Backoff) -> float | None:
    """How long a loop waits before its next round while ``reach`` is down (``backoff`` grows); None (and the
    backoff reset) while the server answers, or with no server to watch."""
    if reach is not None and reach.down:
        return backoff.next()
    backoff.reset()
    return None


class Repeats:
    """One loop's error that is not the server's availability (a 403, a 422): logged when it first comes and when
    it changes, not on every retry; ``cleared`` after a success so that the next failure is said again."""

    def __init__(self) -> None:
        self._last = ""

    def new(self, error: object) -> bool:
        """Whether ``error`` differs from the one said last (and so should be said)."""
        text = str(error)
        fresh = text != self._last
        self._last = text
        return fresh

    def cleared(self) -> None:
        """The loop's call succeeded."""
        self._last = ""


def _short(error: object) -> str:
    """The error on one line, without urllib3's repetition of the whole URL and pool."""
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."
