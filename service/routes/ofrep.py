"""The OpenFeature Remote Evaluation Protocol: ``POST /ofrep/v1/evaluate/flags/{key}`` (one flag) and
``POST /ofrep/v1/evaluate/flags`` (every experiment not archived, with an ETag), for OpenFeature's OFREP
providers in any language (docs/api.md). Wire shapes in ``service.ofrep``.

An evaluation is an assignment: the unit is the context's ``targetingKey``, and the arm comes from the
assignment controller that ``POST .../assign`` calls, with its exposure logging, so both answer alike.
The context's ``segment`` is used by segmented experiments and ignored by the others (one context
serves every flag of a bulk evaluation).
"""

from __future__ import annotations

from flask import Blueprint, Response, request

from .. import ofrep
from ..auth import require_role
from ..bootstrap import get_uow
from ..controller import assignment, experiments
from ..errors import ApiError
from ..exposures import get_exposures
from ..responses import respond_json
from .assignment import STALE_HEADER

bp = Blueprint("ofrep", __name__, url_prefix="/ofrep/v1/evaluate")


@bp.post("/flags/<key>")
@require_role("ingest")
def evaluate_flag(key: str):
    try:
        unit, segment = ofrep.read_context(request.get_data(cache=False))
        snapshot, stale, arm, probability, served = assignment.assign_one(
            get_uow(), key, unit, segment, segment_optional=True, exposures=get_exposures())
    except ofrep.EvaluationProblem as problem:
        return respond_json(ofrep.failure(key, problem.code, problem.details), problem.status)
    except ApiError as error:
        if error.status == 404:
            return respond_json(ofrep.failure(key, ofrep.FLAG_NOT_FOUND, error.message), 404)
        if error.status == 422:  # the segment: missing or unknown for this experiment's segments
            return respond_json(ofrep.failure(key, ofrep.INVALID_CONTEXT, _details(error)), 400)
        raise
    response = respond_json(ofrep.success(snapshot, arm, probability, served))
    if stale:
        response.headers[STALE_HEADER] = f"database unavailable; mixture of round {snapshot.round_index}"
    return response


@bp.post("/flags")
@require_role("ingest")
def evaluate_flags():
    try:
        unit, segment = ofrep.read_context(request.get_data(cache=False))
    except ofrep.EvaluationProblem as problem:
        return respond_json({"errorCode": problem.code, "errorDetails": problem.details}, 400)
    flags = []
    uow, exposures = get_uow(), get_exposures()
    for listed in experiments.list_all(uow):
        try:
            snapshot, _, arm, probability, served = assignment.assign_one(uow, listed.name, unit, segment,
                                                                          segment_optional=True, exposures=exposures)
        except ApiError as error:
            if error.status == 404:  # deleted since it was listed
                continue
            if error.status == 422:
                flags.append(ofrep.failure(listed.name, ofrep.INVALID_CONTEXT, _details(error)))
                continue
            raise
        flags.append(ofrep.success(snapshot, arm, probability, served))
    response = respond_json({"flags": flags})
    tag = ofrep.etag(response.get_data())
    if request.if_none_match.contains(tag.strip('"')):
        response = Response(status=304)
    response.headers["ETag"] = tag
    return response


def _details(error: ApiError) -> str:
    """The sentence of a segment 422 without its body location (the context is not the assign body)."""
    return error.message.removeprefix("segment: ")
