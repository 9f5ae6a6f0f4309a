"""``POST .../assign``: one unit (``{"unit": ...}``, answered with a ``responses.Assignment``) or a batch
(``{"units": [...]}``, a ``responses.AssignmentBatch``)."""

from __future__ import annotations

from flask import Blueprint, current_app

from ..auth import require_role
from ..bootstrap import get_uow
from ..cache import Snapshot
from ..controller import assignment
from ..errors import invalid
from ..exposures import get_exposures
from ..responses import assignment_members, assignments, compact_json, respond_assignments, respond_json
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
        snapshot, stale, arms, probabilities, served = assignment.assign_many(get_uow(), name, units, batch.unit_segments(),
                                                                               exposures=get_exposures())
        app = current_app._get_current_object()
        if compact_json(app):
            response = respond_assignments(app, units, _members(snapshot, arms.tolist(), served), batch=True)
        else:
            response = respond_json({"assignments": assignments(
                units, arms.tolist(), probabilities.tolist(), snapshot.arm_names, snapshot.arm_params,
                snapshot.round_index, served)})
        return _mark_stale(snapshot, stale, response)
    if isinstance(body, dict) and "unit" not in body:
        raise invalid("unit", f"Field required: send {_UNIT_OR_UNITS}.")
    one = parse(AssignOne, body)
    unit = one.unit
    snapshot, stale, arm, probability, served = assignment.assign_one(get_uow(), name, unit, one.segment,
                                                                       exposures=get_exposures())
    app = current_app._get_current_object()
    if compact_json(app):
        response = respond_assignments(app, [unit], _members(snapshot, [arm], None if served is None else [served]),
                                       batch=False)
    else:
        (answer,) = assignments([unit], [arm], [probability], snapshot.arm_names, snapshot.arm_params,
                                snapshot.round_index, None if served is None else [served])
        response = respond_json(answer)
    return _mark_stale(snapshot, stale, response)


def _members(snapshot: Snapshot, arms: list[int], served: list[str] | None) -> list[str]:
    """Each answer's members after the unit (:func:`~service.responses.assignment_members`), written
    once per (segment, arm) and snapshot version and kept in ``snapshot.answer_members``."""
    cache = snapshot.answer_members
    if served is None:
        keys = [(-1, arm) for arm in arms]
    else:
        positions = snapshot.segment_positions
        keys = [(positions[segment], arm) for segment, arm in zip(served, arms)]
    members = list(map(cache.get, keys))
    if None in members:
        for index, key in enumerate(keys):
            if members[index] is None:
                members[index] = cache.get(key) or cache.setdefault(key, _written_members(snapshot, *key))
    return members


def _written_members(snapshot: Snapshot, segment: int, arm: int) -> str:
    if segment < 0:
        return assignment_members(snapshot.arm_names[arm], snapshot.arm_params[arm], snapshot.round_index,
                                  float(snapshot.serving[arm]))
    return assignment_members(snapshot.arm_names[arm], snapshot.arm_params[arm], snapshot.round_index,
                              float(snapshot.segment_serving[segment, arm]), snapshot.segment_names[segment])


def _mark_stale(snapshot, stale: bool, response):
    """Say in ``Pasto-Stale`` that the answer comes from the cached mixture because the database is
    unavailable (it may have closed a round meanwhile; the client keeps the round it was given)."""
    if stale:
        response.headers[STALE_HEADER] = f"database unavailable; mixture of round {snapshot.round_index}"
    return response
