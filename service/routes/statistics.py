"""``POST .../statistics``: batches of pre-aggregated statistics (``service.controller.statistics``)."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..bootstrap import get_uow
from ..controller import statistics
from ..responses import StatisticsResult, respond
from ..schemas import json_bytes

bp = Blueprint("statistics", __name__, url_prefix="/api/v1/experiments")


@bp.post("/<name>/statistics")
@require_role("ingest")
def ingest_statistics(name: str):
    result = statistics.ingest_body(get_uow(), name, json_bytes())  # 415/413 first, then 404/409, then 422
    return respond(StatisticsResult(batch_id=result.batch_id, duplicate=result.duplicate, cells=result.cells,
                                    units=result.units, late_cells=result.late_cells),
                   200 if result.duplicate else 202)
