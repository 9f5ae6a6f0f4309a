"""``POST .../observations``: the webhook that ingests a batch of observations (``service.controller.ingestion``)."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..bootstrap import get_uow
from ..controller import ingestion
from ..responses import IngestResult, respond
from ..schemas import json_bytes

bp = Blueprint("observations", __name__, url_prefix="/api/v1/experiments")


@bp.post("/<name>/observations")
@require_role("ingest")
def ingest_observations(name: str):
    result = ingestion.ingest_body(get_uow(), name, json_bytes())  # 415/413 first, then 404/409, then 422
    return respond(IngestResult(accepted=result.accepted, duplicates=result.duplicates), 202)
