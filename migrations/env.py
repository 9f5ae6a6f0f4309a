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
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


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
