"""Assignment: which arm (parameter setting) a unit gets in the current round.

No database write happens here: the cached snapshot (one version read per request) gives the seed,
the round and the mixture, and ``pasto.hashing`` maps the unit to an arm, so the same unit gets the
same arm for the whole round in every process, and clients can assign locally with the same result.
"""

from __future__ import annotations

from flask import Blueprint, jsonify

from pasto.hashing import buckets, choose_arm, choose_arms

from . import events
from .auth import require_role
from .cache import get_cache
from .errors import invalid
from .schemas import AssignMany, AssignOne, json_body, parse

bp = Blueprint("assignment", __name__, url_prefix="/api/v1/experiments")
_UNIT_OR_UNITS = "either unit (one unit id) or units (a list of unit ids)"


@bp.post("/<name>/assign")
@require_role("ingest")
def assign(name: str):
    body = json_body()
    snapshot = get_cache().get(name)
    if isinstance(body, dict) and "units" in body:
        if "unit" in body:
            raise invalid("unit", f"Send {_UNIT_OR_UNITS}, not both.")
        units = parse(AssignMany, body).units
        arms = choose_arms(snapshot.serving, buckets(snapshot.seed, units, snapshot.round_index))
        probabilities = snapshot.serving[arms].tolist()
        arm_list = arms.tolist()
        names, params, round_index = snapshot.arm_names, snapshot.arm_params, snapshot.round_index
        events.assigned.send(snapshot, arms=arms)
        return jsonify({"assignments": [
            {"unit": unit, "arm": names[arm], "params": params[arm], "round": round_index, "probability": probability}
            for unit, arm, probability in zip(units, arm_list, probabilities)
        ]})
    if isinstance(body, dict) and "unit" not in body:
        raise invalid("unit", f"Field required: send {_UNIT_OR_UNITS}.")
    unit = parse(AssignOne, body).unit
    arm = choose_arm(snapshot.serving_cumulative, snapshot.hasher(unit))
    events.assigned.send(snapshot, arms=[arm])
    return jsonify({
        "unit": unit,
        "arm": snapshot.arm_names[arm],
        "params": snapshot.arm_params[arm],
        "round": snapshot.round_index,
        "probability": float(snapshot.serving[arm]),
    })
