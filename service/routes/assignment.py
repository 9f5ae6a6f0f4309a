"""``POST .../assign``: one unit (``{"unit": ...}``) or a batch (``{"units": [...]}``)."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..controller import assignment
from ..errors import invalid
from ..responses import Assignment, AssignmentBatch, respond
from ..schemas import AssignMany, AssignOne, json_body, parse

bp = Blueprint("assignment", __name__, url_prefix="/api/v1/experiments")
_UNIT_OR_UNITS = "either unit (one unit id) or units (a list of unit ids)"


@bp.post("/<name>/assign")
@require_role("ingest")
def assign(name: str):
    body = json_body()
    if isinstance(body, dict) and "units" in body:
        if "unit" in body:
            raise invalid("unit", f"Send {_UNIT_OR_UNITS}, not both.")
        units = parse(AssignMany, body).units
        snapshot, arms = assignment.assign_many(name, units)
        probabilities = snapshot.serving[arms].tolist()
        names, params, round_index = snapshot.arm_names, snapshot.arm_params, snapshot.round_index
        return respond(AssignmentBatch(assignments=[
            Assignment(unit=unit, arm=names[arm], params=params[arm], round=round_index, probability=probability)
            for unit, arm, probability in zip(units, arms.tolist(), probabilities)
        ]))
    if isinstance(body, dict) and "unit" not in body:
        raise invalid("unit", f"Field required: send {_UNIT_OR_UNITS}.")
    unit = parse(AssignOne, body).unit
    snapshot, arm = assignment.assign_one(name, unit)
    return respond(Assignment(unit=unit, arm=snapshot.arm_names[arm], params=snapshot.arm_params[arm],
                              round=snapshot.round_index, probability=float(snapshot.serving[arm])))
