"""``POST .../assign``: one unit (``{"unit": ...}``, answered with a ``responses.Assignment``) or a batch
(``{"units": [...]}``, a ``responses.AssignmentBatch``)."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..controller import assignment
from ..errors import invalid
from ..responses import assignments, respond_json
from ..schemas import AssignMany, AssignOne, json_body, parse

bp = Blueprint("assignment", __name__, url_prefix="/api/v1/experiments")
STALE_HEADER = "Pasto-Stale"
_UNIT_OR_UNITS = "either unit (one unit id) or units (a list of unit ids)"


@bp.post("/<name>/assign")
@require_role("ingest")
def assign(name: str):
    body = json_body()
    if isinstance(body, dict) and "units" in body:
        if "unit" in body:
            raise invalid("unit", f"Send {_UNIT_OR_UNITS}, not both.")
        batch = parse(AssignMany, body)
        units = batch.units
        snapshot, stale, arms, probabilities, served = assignment.assign_many(name, units, batch.unit_segments())
        return _mark_stale(snapshot, stale, respond_json({"assignments": assignments(
            units, arms.tolist(), probabilities.tolist(), snapshot.arm_names, snapshot.arm_params,
            snapshot.round_index, served)}))
    if isinstance(body, dict) and "unit" not in body:
        raise invalid("unit", f"Field required: send {_UNIT_OR_UNITS}.")
    one = parse(AssignOne, body)
    unit = one.unit
    snapshot, stale, arm, probability, served = assignment.assign_one(name, unit, one.segment)
    (answer,) = assignments([unit], [arm], [probability], snapshot.arm_names, snapshot.arm_params,
                            snapshot.round_index, None if served is None else [served])
    return _mark_stale(snapshot, stale, respond_json(answer))


def _mark_stale(snapshot, stale: bool, response):
    """Say in ``Pasto-Stale`` that the answer comes from the cached mixture because the database is
    unavailable (it may have closed a round meanwhile; the client keeps the round it was given)."""
    if stale:
        response.headers[STALE_HEADER] = f"database unavailable; mixture of round {snapshot.round_index}"
    return response
