"""Fresh SQLite databases at the newest schema without running every migration again for each test.

Nearly every service, dashboard, client and reliability test starts from a new SQLite file migrated
to the head revision: every Alembic revision, 0.3-1 s a test on this 2-core machine, several minutes
over the suite. :func:`upgrade_to_head` runs the real migrations once per test process, into
a template file, and gives each later new database a byte-for-byte copy of that file (what the
migrations would write again: SQLite files do not record their own path). The migrations themselves
are tested in tests/service/test_migrations.py, which calls ``migrations.upgrade`` directly.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import sqlalchemy as sa

import migrations

_template: Path | None = None


def _template_file() -> Path:
    """The SQLite file the migrations made at head in this process (made on first use)."""
    global _template
    if _template is None:
        folder = Path(tempfile.mkdtemp(prefix="pasto-migrated-"))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / "head.sqlite"
        migrations.upgrade(f"sqlite:///{path}")
        # Everything is in the main file once the migrations' connections are closed; a write-ahead
        # log left beside it would hold pages a copy of the file alone would miss.
        assert not Path(f"{path}-wal").exists() and not Path(f"{path}-journal").exists(), sorted(folder.iterdir())
        _template = path
    return _template


def upgrade_to_head(database_url: str) -> None:
    """``migrations.upgrade(database_url)``: a SQLite file that does not exist yet becomes a copy of the
    template; any other database (PostgreSQL, an existing file) is migrated by Alembic."""
    url = sa.engine.make_url(database_url)
    path = url.database
    if url.get_backend_name() != "sqlite" or not path or path == ":memory:" or url.query or os.path.exists(path):
        migrations.upgrade(database_url)
        return
    shutil.copyfile(_template_file(), path)
