"""``GET /metrics`` (a ``metrics`` token, or none with ``PASTO_METRICS_ANONYMOUS``): the Prometheus
exposition of ``service.monitoring``."""

from __future__ import annotations

from flask import Blueprint, Response, current_app
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..auth import require_role
from ..monitoring import scrape_registry

bp = Blueprint("monitoring", __name__)


@bp.get("/metrics")
@require_role("metrics")  # a scrape token, unless PASTO_METRICS_ANONYMOUS opts in
def metrics() -> Response:
    return Response(generate_latest(scrape_registry(current_app._get_current_object())),
                    content_type=CONTENT_TYPE_LATEST)  # already has its charset: mimetype= adds a second
