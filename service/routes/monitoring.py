"""``GET /metrics`` (no token, like ``/healthz``): the Prometheus exposition of ``service.monitoring``."""

from __future__ import annotations

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..monitoring import scrape_registry

bp = Blueprint("monitoring", __name__)


@bp.get("/metrics")
def metrics() -> Response:
    return Response(generate_latest(scrape_registry(current_app._get_current_object())),
                    mimetype=CONTENT_TYPE_LATEST)
