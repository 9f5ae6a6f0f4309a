"""Database engine per application and its sessions (the SQL itself is in ``service.store``).

Every wait on the database has a deadline (:class:`DatabaseTimeouts`, from the ``PASTO_DATABASE_*``
settings): opening a connection, each statement (on PostgreSQL both server-side, ``statement_timeout``,
and client-side, for a server that cannot answer at all, :func:`_deadline_connection_class`), a free
connection of the pool, SQLite's write lock. A database that is down or stalled therefore raises
within seconds; :class:`DatabaseStatus` records the outage and ``service.errors`` answers 503.

SQLite runs in WAL mode with a busy timeout. Write transactions on SQLite start with
``BEGIN IMMEDIATE``: a deferred transaction that reads and then writes fails at once with "database is
locked" when another connection committed in between (the busy timeout does not apply to that case),
so every session opened with :func:`write_session` takes the write lock up front. Reads stay deferred
and run concurrently with a writer thanks to WAL.

A read transaction (:meth:`Database.read`) sees one snapshot of the database, on both backends: SQLite's
deferred transaction keeps the snapshot of its first read until it ends (WAL), and on PostgreSQL read
sessions run at ``REPEATABLE READ`` (the snapshot of their first statement; PostgreSQL's default, READ
COMMITTED, gives each statement the commits made before it). A use case that reads a segmented
experiment's state and then its statistics therefore never sees a close committed between the two
(the state with S segments, statistics with more: an IndexError). Read-only transactions at this level
never fail with a serialization error. Write transactions stay at READ COMMITTED: they lock the rows
they change (``store.lock_experiment``) and must see what committed before each statement.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from flask import Flask, current_app
from sqlalchemy.orm import Session, sessionmaker

from .config import DATABASE_TIMEOUTS, ConfigurationError

log = logging.getLogger(__name__)

_EXTENSION = "pasto.db"


class DatabaseUnreachable(RuntimeError):
    """The database ``PASTO_DATABASE_URL`` names does not accept a connection (server down, wrong host,
    port, credentials or database name, an SQLite file that cannot be opened)."""


class DatabaseFailingFast(DatabaseUnreachable):
    """Refused without trying: this process lost its connection to the database less than
    ``PASTO_DATABASE_FAIL_FAST`` seconds ago, or another request is finding out whether it is back
    (:meth:`DatabaseStatus.admit`)."""


@dataclass(frozen=True)
class DatabaseTimeouts:
    """Deadlines, in seconds, of every wait on the database (defaults: ``service.config.DATABASE_TIMEOUTS``).

    ``connect``: opening a PostgreSQL connection. ``statement``: one statement; PostgreSQL's
    ``statement_timeout`` cancels it server-side, and the client gives up one second later if the
    server does not answer at all (stopped, or a network that drops packets). ``pool``: waiting for a
    free connection of the pool. ``sqlite_busy``: waiting for SQLite's write lock.
    """

    connect: float = DATABASE_TIMEOUTS["PASTO_DATABASE_CONNECT_TIMEOUT"]
    statement: float = DATABASE_TIMEOUTS["PASTO_DATABASE_STATEMENT_TIMEOUT"]
    pool: float = DATABASE_TIMEOUTS["PASTO_DATABASE_POOL_TIMEOUT"]
    sqlite_busy: float = DATABASE_TIMEOUTS["PASTO_SQLITE_BUSY_TIMEOUT"]
    fail_fast: float = DATABASE_TIMEOUTS["PASTO_DATABASE_FAIL_FAST"]

    @classmethod
    def from_config(cls, config) -> DatabaseTimeouts:
        return cls(connect=config["PASTO_DATABASE_CONNECT_TIMEOUT"],
                   statement=config["PASTO_DATABASE_STATEMENT_TIMEOUT"],
                   pool=config["PASTO_DATABASE_POOL_TIMEOUT"],
                   sqlite_busy=config["PASTO_SQLITE_BUSY_TIMEOUT"],
                   fail_fast=config["PASTO_DATABASE_FAIL_FAST"])

    @property
    def longest_attempt(self) -> float:
        """The longest one attempt to use the database can wait: a connection's ping (or a statement)
        up to its client-side deadline, then a new connection up to its connect timeout."""
        return self.statement + CLIENT_DEADLINE_MARGIN + self.connect


#: How much longer than ``statement_timeout`` the client waits for an answer before it gives the
#: connection up: the server's own cancellation (a clean error, the connection kept) comes first.
CLIENT_DEADLINE_MARGIN = 1.0


def is_unavailable_error(error: BaseException) -> bool:
    """Whether ``error`` means the database cannot serve now (down, unreachable, stalled, locked, out
    of connections) rather than a bug or bad data: SQLAlchemy's ``OperationalError`` (connection
    failures, timeouts, SQLite's "database is locked"), a disconnect it detected, a pool checkout
    timeout, :class:`DatabaseUnreachable`, and the same DBAPI errors raised by raw cursors."""
    if isinstance(error, (sa.exc.OperationalError, sa.exc.TimeoutError, DatabaseUnreachable)):
        return True
    if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
        return True
    import sqlite3

    if isinstance(error, sqlite3.OperationalError):
        return True
    try:
        import psycopg
    except ImportError:
        return False
    return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError))



#: What a failed use of the database raises: any SQLAlchemy error or :class:`DatabaseUnreachable`
#: (for modules that catch them without importing SQLAlchemy: only the store and this module do).
DATABASE_ERRORS: tuple[type[Exception], ...] = (sa.exc.SQLAlchemyError, DatabaseUnreachable)

#: A process logs at most one outage (its start and its end) per this many seconds: a database that
#: flaps (SQLite's write lock contended while reads still succeed) does not fill the log either.
OUTAGE_LOG_INTERVAL_SECONDS = 60.0


class DatabaseStatus:
    """Whether this process last found the database usable (``up``, for the ``pasto_database_up``
    gauge), and the log of its outages: one line when the database becomes unavailable and one when
    it is back, not one per failed request. A database that flaps (SQLite's write lock contended
    while reads still succeed) logs at most one outage per :data:`OUTAGE_LOG_INTERVAL_SECONDS`; a
    failure in a period not logged yet is logged once that interval has passed."""

    def __init__(self, fail_fast_seconds: float = DATABASE_TIMEOUTS["PASTO_DATABASE_FAIL_FAST"],
                 probe_seconds: float = 60.0) -> None:
        self.up = True
        self._lock = threading.Lock()
        self._logged_outage_start: float | None = None  # set while a logged outage is not over
        self._last_logged = -OUTAGE_LOG_INTERVAL_SECONDS
        self._failures = 0
        # Fail-fast (a circuit breaker): set by lost(), cleared by succeeded().
        self.fail_fast_seconds = fail_fast_seconds
        self.probe_seconds = probe_seconds
        self._lost = False
        self._lost_at = 0.0
        self._probe_until = 0.0

    def failed(self, error: BaseException) -> None:
        """Record a request (or scheduler run) that failed because the database is unavailable."""
        with self._lock:
            self.up = False
            self._failures += 1
            now = time.monotonic()
            if self._logged_outage_start is not None or now - self._last_logged < OUTAGE_LOG_INTERVAL_SECONDS:
                return
            self._logged_outage_start = self._last_logged = now
            self._failures = 1
        log.error("The database is unavailable (%s); answering 503 database_unavailable until it is back.",
                  _one_line(error))

    def lost(self) -> None:
        """Record a connection that failed or broke (down, unreachable, stalled past its deadline):
        from now on :meth:`admit` refuses database work in this process for ``fail_fast_seconds``.
        Errors that leave the connection usable (SQLite's write lock, a statement cancelled by the
        server's ``statement_timeout``) do not count: the database still answers."""
        with self._lock:
            self._lost = True
            self._lost_at = time.monotonic()
            self._probe_until = 0.0

    def admit(self, connecting: bool = False) -> bool:
        """Raise :class:`DatabaseFailingFast` instead of letting the caller wait for a database this
        process knows is away; free (no lock) while the connection is not lost. True when the caller
        is the one let through to try (it calls :meth:`probe_done` when it has finished).

        Within ``fail_fast_seconds`` of :meth:`lost` everything is refused. After that one caller at a
        time is let through to find out whether the database is back (others are refused while it
        tries, for at most ``probe_seconds``): its success ends the refusals (:meth:`succeeded`), its
        failure starts a new window. ``connecting``: a new connection (the pool replacing a broken one
        inside the current attempt), refused only within the window, so the caller let through can
        connect, but an attempt whose ping just failed does not wait for a connect timeout as well.
        """
        if not self._lost:
            return False
        with self._lock:
            if not self._lost:
                return False
            now = time.monotonic()
            if now - self._lost_at < self.fail_fast_seconds:
                raise DatabaseFailingFast(
                    f"The connection to the database failed {now - self._lost_at:.1f} s ago; not trying again "
                    f"for {self.fail_fast_seconds:g} s (PASTO_DATABASE_FAIL_FAST).")
            if connecting:
                return False
            if now < self._probe_until:
                raise DatabaseFailingFast("The connection to the database failed; another request is finding "
                                          "out whether it is back.")
            self._probe_until = now + self.probe_seconds
            return True

    def probe_done(self) -> None:
        """The caller :meth:`admit` let through has finished (succeeded, failed, or never needed the
        database): the next caller after the window may try."""
        with self._lock:
            self._probe_until = 0.0

    def succeeded(self) -> None:
        """Record a statement that completed: the database is usable (cheap when it already was)."""
        if self._lost:
            with self._lock:
                self._lost = False
                self._probe_until = 0.0
        if self.up:
            return
        with self._lock:
            if self.up:
                return
            self.up = True
            if self._logged_outage_start is None:
                return
            down_for, failures = time.monotonic() - self._logged_outage_start, self._failures
            self._logged_outage_start = None
        log.warning("The database is available again after %.1f s (%d requests or runs failed meanwhile).",
                    down_for, failures)


def _one_line(error: BaseException) -> str:
    cause = getattr(error, "orig", None) or error
    text = " ".join(line.strip() for line in str(cause).splitlines() if line.strip())
    return f"{type(cause).__name__}: {text[:300]}"


@dataclass(frozen=True)
class Database:
    """The engine of one application and its two session factories."""

    engine: sa.Engine
    read_sessions: sessionmaker[Session]
    write_sessions: sessionmaker[Session]
    status: DatabaseStatus = field(default_factory=DatabaseStatus, compare=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def insert(self, table):
        """``INSERT`` with ``on_conflict_do_*`` for this engine's dialect (SQLite or PostgreSQL)."""
        # The dialect's module is imported here, not with this module: an engine imports its own
        # dialect, and a process on SQLite then never loads PostgreSQL's (about 60 ms of CPU at start).
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(table)
        if self.dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            return sqlite.insert(table)
        raise RuntimeError(f"Unsupported database dialect {self.dialect!r}: use SQLite or PostgreSQL.")

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reading, one snapshot of the database for all its statements (REPEATABLE READ
        on PostgreSQL, see the module docstring); rolled back and closed on exit.
        :class:`DatabaseFailingFast` at once while this process knows the database is away
        (:meth:`DatabaseStatus.admit`)."""
        probe = self.status.admit()
        try:
            with self.read_sessions() as session:
                yield session
        finally:
            if probe:
                self.status.probe_done()

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session in one write transaction: committed on success, rolled back on any exception.
        :class:`DatabaseFailingFast` at once while this process knows the database is away."""
        probe = self.status.admit()
        try:
            with self.write_sessions() as session, session.begin():
                yield session
        finally:
            if probe:
                self.status.probe_done()


_URL_EXAMPLES = "sqlite:///path/to/pasto.sqlite or postgresql+psycopg://user:password@host/database"


def make_engine(url: str, timeouts: DatabaseTimeouts = DatabaseTimeouts()) -> sa.Engine:
    """Create an engine for ``url`` with the settings this service relies on and the deadlines of
    ``timeouts``.

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
                parsed, connect_args={"check_same_thread": False, "timeout": timeouts.sqlite_busy},
                pool_timeout=timeouts.pool,
            )
            _configure_sqlite(engine, round(timeouts.sqlite_busy * 1000))
            return engine
        # statement_timeout through libpq's "options" (no extra round trip per connection), after
        # any options the URL gives; connect_timeout is whole seconds in libpq.
        options = " ".join(filter(None, [str(parsed.query.get("options") or ""),
                                         f"-c statement_timeout={round(timeouts.statement * 1000)}"]))
        engine = sa.create_engine(
            parsed, pool_pre_ping=True, pool_size=10, max_overflow=20, pool_timeout=timeouts.pool,
            connect_args={"connect_timeout": max(1, round(timeouts.connect)), "options": options},
        )
        connection_class = _deadline_connection_class(timeouts.statement + CLIENT_DEADLINE_MARGIN)

        @sa.event.listens_for(engine, "do_connect")
        def connect(_dialect, _record, cargs, cparams):
            return connection_class.connect(*cargs, **cparams)

        return engine
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


def _deadline_connection_class(seconds: float) -> type:
    """A psycopg ``Connection`` whose every wait for the server (a statement, a fetch, a commit, the
    pool's ping) gives up after ``seconds``.

    ``statement_timeout`` is enforced by the server, so it does nothing when the server cannot answer:
    stopped (SIGSTOP), swapping, or behind a network that drops packets; on loopback the kernel even
    acknowledges what the client sends, so no TCP timeout fires either. Every blocking operation of a
    psycopg connection goes through :meth:`psycopg.Connection.wait`, whose ``timeout`` raises
    psycopg's ``_WaitTimeout``. The connection is then in an unknown state (half a result may be
    unread): it is closed, so SQLAlchemy sees a disconnect and drops it from the pool.
    """
    import psycopg
    from psycopg import errors

    class DeadlineConnection(psycopg.Connection):
        def wait(self, gen, interval=0.1, timeout=None):
            limit = seconds if timeout is None else min(timeout, seconds)
            try:
                return super().wait(gen, interval=interval, timeout=limit)
            except errors._WaitTimeout:  # psycopg's (internal) wait timeout: give the connection up
                self.close()
                error = psycopg.OperationalError(
                    f"The database server did not answer within {limit:g} s (PASTO_DATABASE_STATEMENT_TIMEOUT "
                    f"+ {CLIENT_DEADLINE_MARGIN:g} s); the connection was closed.")
                error.pasto_deadline = True  # a stalled server, not a dead connection (init_app's handle_error)
                raise error from None

    return DeadlineConnection


#: SQLite's automatic checkpoint threshold, in WAL pages (SQLite's default is 1,000; 10,000 pages of
#: 4 KiB is a WAL of at most about 40 MB). Ingestion inserts random text keys (observation ids, units)
#: into two B-trees, so a batch of 1,000 observations dirties about one leaf page per observation and
#: index once the indexes are large: more than 1,000 pages per commit. With the default every such
#: commit checkpoints (copies its pages into the database file and fsyncs it, the only fsync of
#: synchronous=NORMAL), and that cost grows with the index until it dominates the batch. A 10x larger
#: threshold checkpoints every several batches and copies a leaf dirtied by several of them once
#: (docs/benchmarks.md, "SQLite ingestion over 10^6 observations": bench/sqlite_decay.py).
SQLITE_WAL_AUTOCHECKPOINT_PAGES = 10_000


def _configure_sqlite(engine: sa.Engine, busy_timeout_ms: int) -> None:
    @sa.event.listens_for(engine, "connect")
    def on_connect(dbapi_connection, _record):
        # Let SQLAlchemy's "begin" event below emit BEGIN itself (pysqlite's implicit BEGIN is DEFERRED).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA wal_autocheckpoint={SQLITE_WAL_AUTOCHECKPOINT_PAGES}")
        cursor.execute("PRAGMA foreign_keys=ON")
        # Freed pages are zeroed only where that writes no extra page. Debian's SQLite zeroes every
        # freed page (SQLITE_SECURE_DELETE), which at K = 100,000 wrote a page of zeros into the WAL
        # for each of the thousands of pages the replaced state and the cleared summary input free:
        # clearing the 17.6 MB summary input of K = 100,000 took 167 ms, against 24 ms with FAST
        # (``python bench/serve.py secure-delete``; docs/benchmarks.md, "The round close at large K").
        # Nothing secret is stored in the clear (tokens are kept as hashes).
        cursor.execute("PRAGMA secure_delete=FAST")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def on_begin(connection):
        immediate = connection.get_execution_options().get("pasto_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def init_app(app: Flask) -> Database:
    """Create the application's engine from ``PASTO_DATABASE_URL`` (deadlines from the
    ``PASTO_DATABASE_*`` settings) and register it."""
    database = open_database(app.config["PASTO_DATABASE_URL"], DatabaseTimeouts.from_config(app.config))
    app.extensions[_EXTENSION] = database
    return database


#: The isolation level of PostgreSQL read transactions: one snapshot for all their statements.
READ_ISOLATION = "REPEATABLE READ"


def open_database(url: str, timeouts: DatabaseTimeouts = DatabaseTimeouts()) -> Database:
    """The :class:`Database` of ``url`` with the deadlines of ``timeouts`` and its outage tracking
    (:class:`DatabaseStatus`), without any application: what :func:`init_app` registers, and what a
    use case test or a script gives ``service.store.UnitOfWork``."""
    engine = make_engine(url, timeouts)
    # One snapshot per read transaction (see the module docstring): SQLite's deferred BEGIN gives it.
    reads = engine.execution_options(isolation_level=READ_ISOLATION) if engine.dialect.name == "postgresql" \
        else engine
    database = Database(
        engine=engine,
        read_sessions=sessionmaker(bind=reads, expire_on_commit=False),
        write_sessions=sessionmaker(bind=engine.execution_options(pasto_write=True), expire_on_commit=False),
        status=DatabaseStatus(timeouts.fail_fast, timeouts.longest_attempt),
    )
    status = database.status

    @sa.event.listens_for(engine, "after_cursor_execute")
    def statement_completed(*_):
        status.succeeded()

    @sa.event.listens_for(engine, "checkout")
    def connection_checked_out(*_):
        status.succeeded()  # a new connection, or a pooled one whose ping the server answered

    @sa.event.listens_for(engine, "handle_error")
    def connection_lost(context: sa.engine.ExceptionContext) -> None:
        # A broken connection, the client-side deadline, a failed connect (no connection yet): the
        # database is away, not merely slow on one statement. A ping that failed at once is not: after
        # a restart every pooled connection is dead, and the pool replaces each one (a failed connect
        # then counts); a ping that met the deadline is a server that does not answer.
        if context.is_pre_ping:
            if getattr(context.original_exception, "pasto_deadline", False):
                status.lost()
        elif context.is_disconnect or context.connection is None:
            status.lost()

    @sa.event.listens_for(engine, "do_connect", insert=True)  # before make_engine's, which connects
    def before_connecting(*_):
        status.admit(connecting=True)  # returns None: the dialect (or make_engine's handler) connects
    return database


def get_db(app: Flask | None = None) -> Database:
    """The :class:`Database` of ``app`` (the current application by default)."""
    return (app or current_app).extensions[_EXTENSION]
