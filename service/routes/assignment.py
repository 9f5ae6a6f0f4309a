"""``POST .../assign``: one unit (``{"unit": ...}``, answered with a ``responses.Assignment``) or a batch
(``{"units": [...]}``, a ``responses.AssignmentBatch``)."""

from __future__ import annotations

import io
import re
import time

from flask import Blueprint, Flask, current_app

from .. import events
from ..auth import ROLE_RANK, known_role, require_role
from ..bootstrap import get_uow
from ..cache import Snapshot
from ..config import DEFAULT_METRICS_TOP_ARMS
from ..controller import assignment
from ..errors import invalid
from ..exposures import get_exposures
from ..monitoring import count_request
from ..responses import (assignment_members, assignments, assignments_text, compact_json, respond_assignments,
                         respond_json)
from ..schemas import MAX_EXPERIMENT_NAME, AssignMany, AssignOne, decode_json, json_body, parse
from ..security import NOSNIFF

bp = Blueprint("assignment", __name__, url_prefix="/api/v1/experiments")
ROUTE = "/api/v1/experiments/<name>/assign"
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


# ------------------------------------------------------------------------------ the fast path

#: The assign requests :class:`FastAssign` answers itself: an experiment name as the API
#: creates them (``schemas.ExperimentName``) and nothing else in the path.
_FAST_PATH = re.compile(rf"/api/v1/experiments/([a-z0-9_-]{{1,{MAX_EXPERIMENT_NAME}}})/assign")


class FastAssign:
    """WSGI middleware in front of ``app``: an ordinary assign request is answered here,
    without Flask's request context, URL map and hooks; every other request, and every assign
    request that is not ordinary, goes to Flask unchanged (its body put back when it was read).

    Ordinary means every check the route makes passes on the first try without a side effect: POST
    to ``/api/v1/experiments/<name>/assign`` with no query string, a JSON body of declared length
    within ``MAX_CONTENT_LENGTH`` that parses (no repeated key) and validates as
    :class:`~service.schemas.AssignOne` or :class:`~service.schemas.AssignMany` without segments, a
    bearer token whose role (at least
    ``ingest``) the process knows without a lookup (``auth.known_role``: the admin token, or a token
    looked up in the last second), an unsegmented experiment whose snapshot is cached, compact JSON
    and no exposure log. What is then done is the route's own work: the arm, the ``assigned`` event
    (its counters), the request counter and duration, and the answer with the headers Flask's path
    gives it, the same bytes (``tests/service/test_assign_fast_path.py``). Anything unexpected before
    the event falls back to Flask, which repeats the checks and answers as it always did (401, 404,
    415, 422, ...); nothing is counted twice. It stands in for the service's own request hooks
    (timer and counter, query check, security headers): made over an app with any other hook, or
    once one is added, it hands every request to Flask.
    """

    def __init__(self, app: Flask, wsgi_app) -> None:
        from .. import monitoring, params, security

        self.app = app
        self.flask = wsgi_app
        # The request hooks this path stands in for: the request timer and counter, the query check
        # (no query string here) and the security headers. With any other hook registered, now or
        # later, every request goes through Flask.
        stands_in_for = (
            (), ((None, (params.check_query_strings, monitoring._start_timer)),),
            ((None, (security.add_security_headers, monitoring._count_request)),), (), (),
        )
        self.hooks = self._hooks() if self._hooks() == stands_in_for else None

    def _hooks(self) -> tuple:
        app = self.app
        registries = (app.before_request_funcs, app.after_request_funcs, app.teardown_request_funcs,
                      app.url_value_preprocessors)
        return (tuple(app.teardown_appcontext_funcs),
                *(tuple((key, tuple(functions)) for key, functions in registry.items()) for registry in registries))

    def __call__(self, environ, start_response):
        if (environ.get("REQUEST_METHOD") != "POST" or environ.get("QUERY_STRING")
                or self._hooks() != self.hooks):
            return self.flask(environ, start_response)
        match = _FAST_PATH.fullmatch(environ.get("PATH_INFO", ""))
        if match is None:
            return self.flask(environ, start_response)
        started = time.perf_counter()
        answer = self._answer(environ, match.group(1), started)
        if answer is None:
            return self.flask(environ, start_response)
        status, headers, body = answer
        start_response(status, headers)
        return [body]

    def _answer(self, environ, name: str, started: float):
        """(status, headers, body) of an ordinary request; None after putting back what was read."""
        app = self.app
        length = environ.get("CONTENT_LENGTH", "")
        limit = app.config.get("MAX_CONTENT_LENGTH")
        if (not length.isdigit() or (limit is not None and int(length) > limit)
                or environ.get("CONTENT_TYPE", "").partition(";")[0].strip().lower() != "application/json"):
            return None
        role = known_role(app, environ.get("HTTP_AUTHORIZATION", ""))
        if role is None or ROLE_RANK[role] < ROLE_RANK["ingest"]:
            return None
        uow = get_uow(app)
        if not uow.cache.holds(name) or get_exposures(app) is not None or not compact_json(app):
            return None
        data = environ["wsgi.input"].read(int(length))
        environ["wsgi.input"] = io.BytesIO(data)  # for Flask, if it answers after all
        try:
            request = decode_json(data)
            batch = isinstance(request, dict) and "units" in request
            if batch:
                many = parse(AssignMany, request)
                if many.unit_segments() is not None:
                    return None
                units = many.units
            else:
                one = parse(AssignOne, request)
                if one.segment is not None:
                    return None
                units = [one.unit]
            snapshot, stale = uow.cache.serve(name)
            if snapshot.segmented:
                return None
            if batch:
                arms, _ = assignment.choose_many_unsegmented(snapshot, units)
                arms = arms.tolist()
            else:
                arms = [assignment.choose_unsegmented(snapshot, units[0])[0]]
            body = assignments_text(units, _members(snapshot, arms, None), batch=batch).encode("ascii")
        except Exception:  # ApiError (a 4xx), or the database: Flask repeats the checks and answers
            return None
        # No app context here: the event's receivers get the app's top-arm limit with it.
        events.assigned.send(snapshot, arms=arms,
                             top_arms=app.config.get("PASTO_METRICS_TOP_ARMS", DEFAULT_METRICS_TOP_ARMS))
        headers = [("Content-Type", app.json.mimetype), ("Content-Length", str(len(body)))]
        if stale:
            headers.append((STALE_HEADER, f"database unavailable; mixture of round {snapshot.round_index}"))
        headers.append(NOSNIFF)
        count_request(ROUTE, "POST", 200, started)
        return "200 OK", headers, body
