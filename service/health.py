"""``/healthz`` (no auth) and the OpenAPI document ``/api/v1/openapi.json`` (no auth)."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from flask import Blueprint, current_app, jsonify

from .db import get_db
from .models import SchedulerHeartbeat, utcnow
from .openapi import openapi_document

bp = Blueprint("health", __name__)


def scheduler_alive_within(interval: float) -> timedelta:
    """How recent the newest heartbeat must be for the scheduler to count as alive."""
    return timedelta(seconds=max(3 * interval, 5.0))


@bp.get("/healthz")
def healthz():
    import migrations

    head = migrations.head_revision()
    database = get_db()
    try:
        current = migrations.current_revision(database.engine)
        last_beat = None
        if current == head:
            with database.read() as session:
                last_beat = session.execute(
                    sa.select(SchedulerHeartbeat.beat_at).order_by(SchedulerHeartbeat.beat_at.desc()).limit(1)
                ).scalar_one_or_none()
    except sa.exc.SQLAlchemyError as error:
        response = jsonify({
            "status": "unavailable",
            "database": {"reachable": False, "error": type(error).__name__},
            "scheduler": {"alive": False, "last_heartbeat": None},
            "schema": {"current": None, "head": head},
        })
        response.status_code = 503
        return response
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
