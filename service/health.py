"""``/healthz`` (no auth) and the OpenAPI document ``/api/v1/openapi.json`` (no auth).

``/healthz`` answers within ``PASTO_HEALTHZ_TIMEOUT`` whatever the database does: its check runs in
a thread of its own and, when that takes longer (a stalled server, a connect attempt waiting for its
own timeout), the answer is 503 at once while the check finishes in the background. Later calls wait
for that same check rather than start another, so a stalled database never piles up checks.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import sqlalchemy as sa
from flask import Blueprint, current_app, jsonify

from .db import Database, get_db, is_unavailable_error
from .models import SchedulerHeartbeat, utcnow
from .openapi import openapi_document

bp = Blueprint("health", __name__)


def scheduler_alive_within(interval: float) -> timedelta:
    """How recent the newest heartbeat must be for the scheduler to count as alive."""
    return timedelta(seconds=max(3 * interval, 5.0))


def _read_state(database: Database, head: str):
    """(schema revision, newest scheduler heartbeat or None)."""
    import migrations

    current = migrations.current_revision(database.engine)
    last_beat = None
    if current == head:
        with database.read() as session:
            last_beat = session.execute(
                sa.select(SchedulerHeartbeat.beat_at).order_by(SchedulerHeartbeat.beat_at.desc()).limit(1)
            ).scalar_one_or_none()
    return current, last_beat


class _HealthCheck:
    """At most one database check of the application in flight; callers share it."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pasto-healthz")
        self._lock = threading.Lock()
        self._running: Future | None = None

    def check(self, database: Database, head: str, timeout: float):
        with self._lock:
            if self._running is None or self._running.done():
                self._running = self._executor.submit(_read_state, database, head)
            running = self._running
        return running.result(timeout=timeout)


_checks_lock = threading.Lock()


def _health_check(app) -> _HealthCheck:
    with _checks_lock:
        return app.extensions.setdefault("pasto.healthz", _HealthCheck())


class DatabaseGuardedCollector:
    """A Prometheus collector around ``inner`` (one that reads the database at scrape time) that adds
    ``pasto_database_up``: 1 when the database answered, 0 when it is unavailable, in which case the
    scrape still succeeds with the other series (event counters, this gauge) instead of failing."""

    def __init__(self, inner, database: Database) -> None:
        self.inner = inner
        self.database = database

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        try:
            collected = list(self.inner.collect())
        except Exception as error:
            if not is_unavailable_error(error):
                raise
            self.database.status.failed(error)
            collected = []
        yield from collected
        up = GaugeMetricFamily("pasto_database_up",
                               "1 when this process last found the database usable, 0 during an outage.")
        up.add_metric([], 1.0 if self.database.status.up else 0.0)
        yield up


def _unavailable(head: str, error: str):
    response = jsonify({
        "status": "unavailable",
        "database": {"reachable": False, "error": error},
        "scheduler": {"alive": False, "last_heartbeat": None},
        "schema": {"current": None, "head": head},
    })
    response.status_code = 503
    response.headers["Retry-After"] = str(current_app.config["PASTO_DATABASE_RETRY_AFTER"])
    return response


@bp.get("/healthz")
def healthz():
    import migrations

    head = migrations.head_revision()
    database = get_db()
    timeout = current_app.config["PASTO_HEALTHZ_TIMEOUT"]
    try:
        current, last_beat = _health_check(current_app._get_current_object()).check(database, head, timeout)
    except FutureTimeout:
        return _unavailable(head, f"no answer within {timeout:g} s (PASTO_HEALTHZ_TIMEOUT)")
    except sa.exc.SQLAlchemyError as error:
        if is_unavailable_error(error):
            database.status.failed(error)
        return _unavailable(head, type(error).__name__)
    alive = last_beat is not None and utcnow() - last_beat <= scheduler_alive_within(
        current_app.config["PASTO_SCHEDULER_INTERVAL"])
    schema_ok = current == head
    response = jsonify({
        "status": "ok" if schema_ok else "unavailable",
        "database": {"reachable": True},
        "scheduler": {"alive": alive, "last_heartbeat": None if last_beat is None else
                      last_beat.isoformat().replace("+00:00", "Z")},
        "schema": {"current": current, "head": head},
    })
    response.status_code = 200 if schema_ok else 503
    return response


@bp.get("/api/v1/openapi.json")
def openapi():
    return jsonify(openapi_document())
