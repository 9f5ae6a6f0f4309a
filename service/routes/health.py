"""``/healthz`` (no auth) and the OpenAPI document ``/api/v1/openapi.json`` (no auth)."""

from __future__ import annotations

from datetime import timedelta

from flask import Blueprint, current_app, jsonify, request

from ..auth import authenticate
from ..bootstrap import get_uow
from ..controller import reports
from ..errors import ApiError
from ..openapi import openapi_document
from ..responses import Health, HealthDatabase, HealthScheduler, HealthSchema, HealthSource, respond

bp = Blueprint("health", __name__)


def scheduler_alive_within(interval: float) -> timedelta:
    """How recent the newest heartbeat must be for the scheduler to count as alive."""
    return timedelta(seconds=max(3 * interval, 5.0))


def _may_read_sources() -> bool:
    """Whether the request's bearer token may read experiments (then the sources' messages are shown).

    Without a token, or with one that is not valid, ``/healthz`` still answers, without any message: a
    message comes from the source's engine, and only readers of the experiment may see it."""
    if not request.headers.get("Authorization"):
        return False
    try:
        authenticate("read")
    except ApiError:
        return False
    return True


@bp.get("/healthz")
def healthz():
    """Within ``PASTO_HEALTHZ_TIMEOUT`` whatever the database does (``controller.reports.health``)."""
    health = reports.health(get_uow(), scheduler_alive_within(current_app.config["PASTO_SCHEDULER_INTERVAL"]),
                            current_app.config["PASTO_HEALTHZ_TIMEOUT"])
    if not health.reachable:
        response = respond(Health(
            status="unavailable", database=HealthDatabase(reachable=False, error=health.error),
            scheduler=HealthScheduler(alive=False, last_heartbeat=None),
            schema=HealthSchema(current=None, head=health.head)), 503)
        response.headers["Retry-After"] = str(current_app.config["PASTO_DATABASE_RETRY_AFTER"])
        return response
    schema_ok = health.current == health.head
    # A failing metric source or a scheduler that stopped beating degrades, it does not fail, the service:
    # it serves every experiment (a 503 would make a load balancer take a healthy server out). A database
    # no scheduler ever ran against (rounds closed by hand) is not degraded.
    stalled = health.last_heartbeat is not None and not health.alive
    status = ("degraded" if health.failing_sources or stalled else "ok") if schema_ok else "unavailable"
    readable = _may_read_sources() if health.failing_sources else False
    return respond(Health(
        status=status,
        database=HealthDatabase(reachable=True),
        scheduler=HealthScheduler(alive=health.alive, last_heartbeat=None if health.last_heartbeat is None else
                                  health.last_heartbeat.isoformat().replace("+00:00", "Z")),
        schema=HealthSchema(current=health.current, head=health.head),
        sources=[HealthSource(experiment=name, since=view["since"], message=view["message"]) if readable
                 else HealthSource(experiment=name, since=view["since"])
                 for name, view in health.failing_sources]), 200 if schema_ok else 503)


@bp.get("/api/v1/openapi.json")
def openapi():
    return jsonify(openapi_document())
