"""Alembic migrations, packaged so that ``pasto db upgrade`` works after ``pip install``.

The Alembic configuration is built in code (:func:`alembic_config`) instead of an ``alembic.ini``
so that it always points at this package's folder, wherever it is installed.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

SCRIPT_LOCATION = Path(__file__).resolve().parent


def service_models():
    """``service.models`` of the service beside this package: ``service`` in a checkout, ``pasto.service``
    when installed (pyproject.toml ships both folders inside ``pasto``)."""
    return importlib.import_module(f"{__name__.rpartition('migrations')[0]}service.models")


def alembic_config(database_url: str) -> Config:
    """An Alembic ``Config`` for this package's migrations against ``database_url``."""
    config = Config()
    config.attributes["target_metadata"] = service_models().Base.metadata
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    # ConfigParser interpolation would treat "%" in URLs (escaped passwords) as a reference.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Upgrade the database at ``database_url`` to ``revision``."""
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Downgrade the database at ``database_url`` to ``revision``."""
    command.downgrade(alembic_config(database_url), revision)


@functools.cache
def head_revision() -> str:
    """The newest revision shipped with this package."""
    head = ScriptDirectory(str(SCRIPT_LOCATION)).get_current_head()
    assert head is not None, "The migrations package has no revisions."
    return head


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the database behind ``engine`` is at (None when never migrated)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
