"""``POST .../statistics``: batches of pre-aggregated statistics (``service.controller.statistics``)."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..bootstrap import get_uow
from ..controller import ingestion, statistics
from ..responses import StatisticsResult, respond
from ..schemas import StatisticsBatch, json_bytes, parse_json

bp = Blueprint("statistics", __name__, url_prefix="/api/v1/experiments")


@bp.post("/<name>/statistics")
@require_role("ingest")
def ingest_statistics(name: str):
    body = json_bytes()
    snapshot = ingestion.open_experiment(get_uow(), name)  # 404 or 409 before a 422 about the body
    batch = parse_json(StatisticsBatch, body, also_check=lambda data: statistics.name_problems(get_uow(), name, data))
    result = statistics.ingest_statistics(get_uow(), snapshot, batch)
    return respond(StatisticsResult(batch_id=result.batch_id, duplicate=result.duplicate, cells=result.cells,
                                    units=result.units, late_cells=result.late_cells),
                   200 if result.duplicate else 202)
