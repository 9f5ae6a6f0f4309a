"""Alembic environment: runs migrations online against ``sqlalchemy.url`` (set by ``alembic_config``)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

config = context.config
# Set by migrations.alembic_config from the service beside the migrations (its import name differs
# between a checkout and an installed wheel); the checkout's when Alembic is run by hand.
target_metadata = config.attributes.get("target_metadata")
if target_metadata is None:
    from service.models import Base

    target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url"), poolclass=sa.pool.NullPool)
    if engine.dialect.name == "sqlite":
        _transactional_ddl(engine)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


def _transactional_ddl(engine: sa.Engine) -> None:
    """SQLite: the migrations' DDL inside their transaction too, so that a failed upgrade or downgrade
    leaves the database as it was (SQLite's DDL is transactional, but pysqlite only opens a transaction
    before a data statement: an ALTER TABLE or a batch operation's table rebuild run before one would
    stay). SQLAlchemy's recipe for pysqlite: the driver opens no transaction, the "begin" event does."""

    @sa.event.listens_for(engine, "connect")
    def on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None

    @sa.event.listens_for(engine, "begin")
    def on_begin(connection):
        connection.exec_driver_sql("BEGIN")


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("Offline (SQL script) migrations are not supported; run `pasto db upgrade`.")
run_migrations_online()
