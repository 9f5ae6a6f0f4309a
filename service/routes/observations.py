"""``POST .../observations``: the webhook that ingests a batch of observations (``service.controller.ingestion``)."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..bootstrap import get_uow
from ..controller import ingestion
from ..responses import IngestResult, respond
from ..schemas import ObservationBatch, json_bytes, parse_json

bp = Blueprint("observations", __name__, url_prefix="/api/v1/experiments")


@bp.post("/<name>/observations")
@require_role("ingest")
def ingest_observations(name: str):
    body = json_bytes()
    snapshot = ingestion.open_experiment(get_uow(), name)  # 404 or 409 before a 422 about the body
    # Validated straight from the bytes (schemas.parse_json): no intermediate Python objects.
    batch = parse_json(ObservationBatch, body, also_check=lambda data: ingestion.name_problems(get_uow(), name, data))
    result = ingestion.ingest(get_uow(), snapshot, batch.observations)
    return respond(IngestResult(accepted=result.accepted, duplicates=result.duplicates), 202)
