"""Write transactions that queue in the process, not in SQLite's busy handler.

SQLite takes one writer at a time. A second writer of the same process that finds the database locked
waits in SQLite's busy handler, which sleeps in growing steps (1, 2, 5, ... up to 100 ms) between tries:
a group commit behind a 10 ms plan write could sleep 100 ms, and behind a run of them much longer. On
SQLite the service's own writers (the group commit, the healer's journal, retention) queue on a lock
here instead, handed over as soon as the transaction ahead ends. PostgreSQL takes concurrent writers
itself; there this only opens the transaction.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine


class Writes:
    """Opens write transactions on an engine, one at a time in this process on SQLite."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.RLock() if engine.dialect.name == "sqlite" else None

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A write transaction, committed when the block ends (rolled back on an error)."""
        if self._lock is None:
            with self.engine.begin() as conn:
                yield conn
            return
        with self._lock, self.engine.begin() as conn:
            yield conn
