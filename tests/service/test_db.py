"""``service.db``: the database's outage status."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from service.db import make_engine


def test_database_status_logs_an_outage_once_and_a_flapping_database_at_most_once_a_minute(caplog, monkeypatch):
    import logging

    import service.db as db_module

    clock = [1000.0]
    monkeypatch.setattr(db_module.time, "monotonic", lambda: clock[0])
    status = db_module.DatabaseStatus()
    error = sa.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))
    with caplog.at_level(logging.WARNING, logger="service.db"):
        for _ in range(50):  # an outage: many failed requests
            status.failed(error)
            clock[0] += 0.1
        assert status.up is False
        status.succeeded()
        assert status.up is True
        for _ in range(100):  # then flapping for 20 s: lines only for the first outage
            status.failed(error)
            clock[0] += 0.1
            status.succeeded()
            clock[0] += 0.1
        status.failed(error)
        clock[0] += 60  # a minute later, still failing: logged again
        status.failed(error)
        status.succeeded()
    messages = [record.getMessage() for record in caplog.records]
    assert [m.split(" (")[0] for m in messages] == [
        "The database is unavailable", "The database is available again after 5.0 s",
        "The database is unavailable", "The database is available again after 0.0 s"]
    assert "50 requests or runs failed" in messages[1] and "connection refused" in messages[0]


def test_sqlite_connections_checkpoint_the_wal_every_ten_thousand_pages(tmp_path):
    """Every SQLite connection pasto opens carries its pragmas, the ingestion checkpoint threshold
    (``SQLITE_WAL_AUTOCHECKPOINT_PAGES``, not SQLite's default of 1,000) among them."""
    from service.db import SQLITE_WAL_AUTOCHECKPOINT_PAGES

    engine = make_engine(f"sqlite:///{tmp_path / 'pragmas.sqlite'}")
    try:
        with engine.connect() as first, engine.connect() as second:  # two pooled connections, both set up
            for connection in (first, second):
                pragma = connection.exec_driver_sql
                assert pragma("PRAGMA wal_autocheckpoint").scalar() == SQLITE_WAL_AUTOCHECKPOINT_PAGES == 10_000
                assert pragma("PRAGMA journal_mode").scalar() == "wal"
                assert pragma("PRAGMA synchronous").scalar() == 1  # NORMAL
                assert pragma("PRAGMA secure_delete").scalar() == 2  # FAST
    finally:
        engine.dispose()


def test_after_a_lost_connection_the_process_fails_fast_then_lets_one_request_try_again(monkeypatch):
    import service.db as db_module
    from service.db import DatabaseFailingFast

    clock = [1000.0]
    monkeypatch.setattr(db_module.time, "monotonic", lambda: clock[0])
    status = db_module.DatabaseStatus(fail_fast_seconds=2.0, probe_seconds=14.0)
    status.admit()  # nothing lost: admitted
    status.lost()
    for connecting in (False, True):
        try:
            status.admit(connecting=connecting)
        except DatabaseFailingFast as refused:
            assert "PASTO_DATABASE_FAIL_FAST" in str(refused)
        else:
            raise AssertionError("admitted within the fail-fast window")
    clock[0] += 2.5
    status.admit()  # the window is over: this caller finds out whether the database is back
    status.admit(connecting=True)  # ... and may open a connection to do so
    try:
        status.admit()  # another caller meanwhile is refused
    except DatabaseFailingFast as refused:
        assert "another request" in str(refused)
    else:
        raise AssertionError("two callers were let through while the database is away")
    status.lost()  # the try failed: a new window
    clock[0] += 1.0
    with pytest.raises(DatabaseFailingFast):  # admitted within the new fail-fast window would be wrong
        status.admit(connecting=True)
    clock[0] += 14.0 + 2.0  # a try that neither succeeded nor failed (its request ended otherwise)
    status.admit()
    status.succeeded()  # the database answered: everyone is admitted again
    status.admit()
    status.admit()


def test_a_stalled_server_costs_one_connect_timeout_then_requests_fail_fast(tmp_path):
    """A PostgreSQL "server" that accepts TCP connections and never answers (what a stopped server
    looks like on loopback): the first access waits for the connect timeout, the next ones within
    ``PASTO_DATABASE_FAIL_FAST`` are refused at once, and the first one after it tries again."""
    import socket
    import time

    from service import create_app
    from service.db import DatabaseFailingFast, DatabaseUnreachable, get_db, is_unavailable_error

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes the handshakes; nobody ever reads or answers
    port = listener.getsockname()[1]
    try:
        app = create_app({"PASTO_DATABASE_URL": f"postgresql+psycopg://pasto:x@127.0.0.1:{port}/pasto",
                          "PASTO_CHECK_SCHEMA": False, "PASTO_DATABASE_CONNECT_TIMEOUT": 2,
                          "PASTO_DATABASE_FAIL_FAST": 3})
        database = get_db(app)

        def attempt() -> tuple[BaseException, float]:
            started = time.monotonic()
            try:
                with database.read() as session:
                    session.execute(sa.text("SELECT 1"))
            except Exception as error:  # noqa: BLE001 - what it is is asserted by the caller
                return error, time.monotonic() - started
            raise AssertionError("a server that never answers answered")

        first, waited = attempt()
        assert is_unavailable_error(first) and not isinstance(first, DatabaseUnreachable), repr(first)
        assert waited >= 1.5, waited
        for _ in range(5):
            refused, waited = attempt()
            assert isinstance(refused, DatabaseFailingFast) and is_unavailable_error(refused), repr(refused)
            assert waited < 0.5, waited
        time.sleep(3.2)
        retried, waited = attempt()
        assert not isinstance(retried, DatabaseFailingFast) and waited >= 1.5, (repr(retried), waited)
        database.engine.dispose()
    finally:
        listener.close()


@pytest.mark.postgres
def test_a_connection_that_died_in_the_version_check_is_not_returned_to_the_pool(postgres_url, caplog):
    """The server ends the connection in the middle of the assignment path's version check: the check
    fails once (the caller logs the outage), and the dead connection is dropped, not handed back to the
    pool, whose reset of it would log a traceback ("Exception during reset or similar")."""
    import logging
    import threading
    import time

    from service import store
    from tests.service.conftest import make_app
    from service.db import get_db

    app = make_app(postgres_url)
    database = get_db(app)
    assert store.experiment_version(database, "none") is None  # the pool holds a live connection now
    blocker = sa.create_engine(postgres_url)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.pool")
    errors = []
    with blocker.connect() as connection:
        connection.execute(sa.text("LOCK TABLE experiments IN ACCESS EXCLUSIVE MODE"))

        def check():
            try:
                store.experiment_version(database, "none")
            except Exception as error:  # the connection was ended under it
                errors.append(error)

        checker = threading.Thread(target=check)
        checker.start()
        # Hang guard: the check waits on the lock within milliseconds.
        deadline = time.monotonic() + 10
        while True:
            connection.execute(sa.text("SELECT pg_stat_clear_snapshot()"))  # a fresh view in this transaction
            waiting = connection.execute(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%experiments%'"
            )).scalars().all()
            if waiting:
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        connection.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": waiting[0]})
        checker.join(timeout=30)
        connection.rollback()
    blocker.dispose()
    import psycopg

    assert len(errors) == 1 and isinstance(errors[0], psycopg.OperationalError), errors  # the raw DBAPI's
    assert not [record for record in caplog.records if "Exception during reset" in record.getMessage()
                or record.exc_info], [record.getMessage() for record in caplog.records]
    assert store.experiment_version(database, "none") is None  # the next check has a live connection
    database.engine.dispose()
