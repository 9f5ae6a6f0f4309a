"""``service.db``: the database's outage status."""

from __future__ import annotations

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
    finally:
        engine.dispose()
