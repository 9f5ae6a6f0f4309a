"""Alembic migrations, packaged so that ``pasto db upgrade`` works after ``pip install``.

The Alembic configuration is built in code (:func:`alembic_config`) instead of an ``alembic.ini``
so that it always points at this package's folder, wherever it is installed.
"""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

if TYPE_CHECKING:
    from alembic.config import Config

SCRIPT_LOCATION = Path(__file__).resolve().parent
#: Alembic's table of the revision a database is at (its default name, which env.py keeps).
VERSION_TABLE = "alembic_version"

# Alembic is imported by the functions that migrate, not here: every server process and CLI command
# checks the schema at start (service.check_schema, /healthz), and importing Alembic (with Mako) and
# loading every revision's module for that took ~0.25 s of CPU a process. head_revision and
# current_revision read the same things without it (tests/service/test_migrations.py compares them
# with Alembic's ScriptDirectory and MigrationContext).


def service_models():
    """``service.models`` of the service beside this package: ``service`` in a checkout, ``pasto.service``
    when installed (pyproject.toml ships both folders inside ``pasto``)."""
    return importlib.import_module(f"{__name__.rpartition('migrations')[0]}service.models")


def alembic_config(database_url: str) -> Config:
    """An Alembic ``Config`` for this package's migrations against ``database_url``."""
    from alembic.config import Config

    config = Config()
    config.attributes["target_metadata"] = service_models().Base.metadata
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    # ConfigParser interpolation would treat "%" in URLs (escaped passwords) as a reference.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Upgrade the database at ``database_url`` to ``revision``."""
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    """Downgrade the database at ``database_url`` to ``revision``."""
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


def _revision_ids(path: Path) -> tuple[str, tuple[str, ...]]:
    """(revision, down revisions) of one revision file: its module-level ``revision`` and
    ``down_revision`` assignments (a string, None, or a tuple of strings for a merge), read without
    running the module."""
    found: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("revision", "down_revision"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            if node.target.id in ("revision", "down_revision"):
                found[node.target.id] = ast.literal_eval(node.value)
    revision, down = found.get("revision"), found.get("down_revision")
    assert isinstance(revision, str), f"{path} assigns no revision string."
    downs = () if down is None else (down,) if isinstance(down, str) else tuple(down)
    return revision, downs


@functools.cache
def head_revision() -> str:
    """The newest revision shipped with this package: the one revision of ``versions/`` that no other
    revises (what Alembic's ``ScriptDirectory.get_current_head`` answers)."""
    files = sorted(path for path in (SCRIPT_LOCATION / "versions").glob("*.py") if path.name != "__init__.py")
    revisions = dict(_revision_ids(path) for path in files)
    revised = {down for downs in revisions.values() for down in downs}
    heads = sorted(set(revisions) - revised)
    assert heads, "The migrations package has no revisions."
    assert len(heads) == 1, f"The migrations package has several heads: {', '.join(heads)}."
    return heads[0]


def current_revision(engine: sa.Engine) -> str | None:
    """The revision the database behind ``engine`` is at (None when never migrated): the row of
    :data:`VERSION_TABLE`, as Alembic's ``MigrationContext.get_current_revision`` reads it."""
    with engine.connect() as connection:
        if not sa.inspect(connection).has_table(VERSION_TABLE):
            return None
        heads = connection.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(heads) > 1:  # Alembic's CommandError: pasto's migrations never branch
        raise RuntimeError(f"The database is at several revisions ({', '.join(heads)}); pasto's never branch.")
    return heads[0] if heads else None
