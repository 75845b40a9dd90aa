"""Alembic migrations of the kmend store."""
