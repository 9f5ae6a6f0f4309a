"""Database engine per application and its sessions (the SQL itself is in ``service.store``).

SQLite runs in WAL mode with a busy timeout. Write transactions on SQLite start with
``BEGIN IMMEDIATE``: a deferred transaction that reads and then writes fails at once with "database is
locked" when another connection committed in between (the busy timeout does not apply to that case),
so every session opened with :func:`write_session` takes the write lock up front. Reads stay deferred
and run concurrently with a writer thanks to WAL.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from flask import Flask, current_app
from sqlalchemy.orm import Session, sessionmaker

from .config import ConfigurationError

_EXTENSION = "pasto.db"
SQLITE_BUSY_TIMEOUT_MS = 30_000


class DatabaseUnreachable(RuntimeError):
    """The database ``PASTO_DATABASE_URL`` names does not accept a connection (server down, wrong host,
    port, credentials or database name, an SQLite file that cannot be opened)."""


@dataclass(frozen=True)
class Database:
    """The engine of one application and its two session factories."""

    engine: sa.Engine
    read_sessions: sessionmaker[Session]
    write_sessions: sessionmaker[Session]

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reading; rolled back and closed on exit."""
        with self.read_sessions() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session in one write transaction: committed on success, rolled back on any exception."""
        with self.write_sessions() as session, session.begin():
            yield session


_URL_EXAMPLES = "sqlite:///path/to/pasto.sqlite or postgresql+psycopg://user:password@host/database"


def make_engine(url: str) -> sa.Engine:
    """Create an engine for ``url`` with the settings this service relies on.

    Raises :class:`~service.config.ConfigurationError` naming ``PASTO_DATABASE_URL`` when the URL does
    not parse, names a database other than SQLite or PostgreSQL or a driver that is not installed, or
    puts an SQLite file where its folder cannot be created. Nothing is connected to yet.
    """
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise ConfigurationError(
            f"PASTO_DATABASE_URL {_hide_password(url)!r} is not a database URL; use {_URL_EXAMPLES}."
        ) from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigurationError(
            f"PASTO_DATABASE_URL {shown} names a {parsed.get_backend_name()} database; pasto works with "
            f"SQLite and PostgreSQL: {_URL_EXAMPLES}."
        )
    try:
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                folder = Path(parsed.database).parent
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                except OSError as error:
                    raise ConfigurationError(
                        f"PASTO_DATABASE_URL {shown}: the folder {folder} for the SQLite file cannot be "
                        f"created ({error.strerror})."
                    ) from None
            engine = sa.create_engine(
                parsed, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
            )
            _configure_sqlite(engine)
            return engine
        return sa.create_engine(parsed, pool_pre_ping=True, pool_size=10, max_overflow=20)
    except (sa.exc.NoSuchModuleError, ImportError) as error:  # an unknown driver name, or one not installed
        raise ConfigurationError(
            f"PASTO_DATABASE_URL {shown}: its database driver cannot be loaded ({error}); pasto installs "
            f"psycopg for PostgreSQL and uses Python's sqlite3: {_URL_EXAMPLES}."
        ) from None


def _hide_password(url: str) -> str:
    """``url`` with the password of ``scheme://user:password@host`` replaced by ``***``, for a URL
    SQLAlchemy could not parse (and so cannot mask)."""
    return re.sub(r"(://[^:/@]*:).*@", r"\1***@", url)


def check_connection(engine: sa.Engine) -> None:
    """Connect once; :class:`DatabaseUnreachable` naming the database and the driver's reason if that fails."""
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as error:  # the DBAPI's connection failures; SQL errors are other classes
        reason = " ".join(line.strip() for line in str(error.orig).splitlines() if line.strip())
        where = engine.url.render_as_string(hide_password=True)
        raise DatabaseUnreachable(
            f"Cannot connect to the database {where} (PASTO_DATABASE_URL): "
            f"{reason if reason.endswith(('.', '?', '!')) else reason + '.'}"
        ) from error


def _configure_sqlite(engine: sa.Engine) -> None:
    @sa.event.listens_for(engine, "connect")
    def on_connect(dbapi_connection, _record):
        # Let SQLAlchemy's "begin" event below emit BEGIN itself (pysqlite's implicit BEGIN is DEFERRED).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def on_begin(connection):
        immediate = connection.get_execution_options().get("pasto_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def init_app(app: Flask) -> Database:
    """Create the application's engine from ``PASTO_DATABASE_URL`` and register it."""
    engine = make_engine(app.config["PASTO_DATABASE_URL"])
    database = Database(
        engine=engine,
        read_sessions=sessionmaker(bind=engine, expire_on_commit=False),
        write_sessions=sessionmaker(bind=engine.execution_options(pasto_write=True), expire_on_commit=False),
    )
    app.extensions[_EXTENSION] = database
    return database


def get_db(app: Flask | None = None) -> Database:
    """The :class:`Database` of ``app`` (the current application by default)."""
    return (app or current_app).extensions[_EXTENSION]
