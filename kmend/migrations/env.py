"""Alembic environment: run with the connection handed in by kmend.store.migrate."""

from alembic import context

from kmend.store.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    from sqlalchemy import create_engine

    url = context.config.get_main_option("sqlalchemy.url")
    with create_engine(url).begin() as conn:
        context.configure(connection=conn, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
else:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()
