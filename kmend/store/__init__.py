"""Persistence on SQLAlchemy 2: SQLite by default, PostgreSQL by URL."""

from kmend.store.store import IngestOutcome, Store

__all__ = ["IngestOutcome", "Store"]
