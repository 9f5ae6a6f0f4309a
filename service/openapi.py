"""The OpenAPI 3.1 document of the JSON API, as data.

Request body schemas are generated from the pydantic models that validate them (``service.schemas``),
response schemas from the models the routes serialise with (``service.responses``), so what is
published is what is enforced and what is sent. ``tests/service/test_openapi.py`` checks that every route of
the application is documented and every documented operation exists.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

from pydantic.json_schema import models_json_schema

from . import ofrep, responses, schemas

API_VERSION = "1.0.0"
_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": "The body is not valid JSON.",
    "401": "Missing or invalid bearer token.",
    "403": "The token's role is too low for this operation.",
    "404": "No experiment with this name.",
    "409": "The experiment's state does not allow this (duplicate name, stopped, paused, round already closed, "
           "a statistics batch id sent with other content, data for a round whose ids retention pruned, "
           "not archived).",
    "413": "The request body is larger than the server accepts.",
    "415": "The body is not JSON (Content-Type must be application/json).",
    "422": "The body is JSON but invalid; the message and details name the offending item.",
    "429": "Too many unknown tokens from this client address (code too_many_requests); Retry-After says when "
           "the minute ends. A valid token is never refused this way.",
    "502": "The experiment's metric source failed (code source_failed, with the source's sentence); nothing changed.",
    "503": "The database is down, stalled, locked or out of connections (code database_unavailable); nothing "
           "changed: send the same request again after Retry-After.",
}
#: The statuses whose answer carries ``Retry-After`` (seconds).
_RETRY_AFTER = {"429", "503"}

_NAME_PARAMETER = {
    "name": "name", "in": "path", "required": True, "description": "The experiment's name.",
    "schema": {"type": "string", "pattern": "^[a-z0-9_-]{1,64}$"},
}

_SINCE_PARAMETER = {
    "name": "since", "in": "query", "required": False, "description": "First round index to return (default 0).",
    "schema": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
}
_ARCHIVED_PARAMETER = {
    "name": "archived", "in": "query", "required": False,
    "description": "false (default): the experiments not archived; true: the archived ones.",
    "schema": {"type": "string", "enum": ["true", "false"]},
}
_LIMIT_PARAMETER = {
    "name": "limit", "in": "query", "required": False,
    "description": "At most this many rounds, 1 to 1,000 (default 200,000 / K, within the same bounds).",
    "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
}

_ARMS_PARAMETER = {
    "name": "arms", "in": "query", "required": False,
    "description": "Summarise per-arm arrays for large K: keep the N arms of largest max(p_t, deployed) (largest "
                   "first, ties by position; listed in arm_summary) and sum the others into rest. Without it, or "
                   "with N >= K, every arm in arm order (and no arm_summary or rest).",
    "schema": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
}

_EVENT_SINCE_PARAMETER = {
    "name": "since", "in": "query", "required": False, "description": "First event id to return (default 0).",
    "schema": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
}
_EVENT_LIMIT_PARAMETER = {
    "name": "limit", "in": "query", "required": False, "description": "At most this many events (default and most 1,000).",
    "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
}


def _operation(summary: str, role: str | None, responses: dict[str, Any], errors: tuple[str, ...] = (),
               body: dict[str, Any] | None = None, body_required: bool = True,
               path_name: bool = True) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": dict(responses)}
    if role is None:
        operation["security"] = []
    else:
        operation["description"] = f"Needs a token with the `{role}` role (or higher)."
        errors = ("401", "403", "429", "503", *errors)
    if path_name:
        operation["parameters"] = [_NAME_PARAMETER]
        errors = (*errors, "404")
    if body is not None:
        operation["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": body}}}
        errors = (*errors, "400", "413", "415", "422")
    for status in sorted(set(errors)):
        operation["responses"][status] = _json(_ref("Error"), _ERRORS[status])
        if status in _RETRY_AFTER:
            operation["responses"][status]["headers"] = {"Retry-After": {
                "description": "Seconds to wait before sending the same request again.",
                "schema": {"type": "integer", "minimum": 1}}}
    return operation


def _paths() -> dict[str, Any]:
    experiment = {"200": _json(_ref("Experiment"), "The experiment.")}
    return {
        "/healthz": {"get": _operation(
            "Database reachable, scheduler alive, schema version.", None,
            {"200": _json(_ref("Health"), "Healthy (status ok), or degraded: a running experiment's metric source "
                                          "is failing (listed in sources)."),
             "503": _json(_ref("Health"), "Database or schema not ready.")},
            path_name=False)},
        "/metrics": {"get": _operation(
            "Prometheus metrics (text exposition format).", "metrics",
            {"200": {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}}},
            path_name=False)},
        "/api/v1/openapi.json": {"get": _operation(
            "This document.", None, {"200": {"description": "OpenAPI 3.1 document.",
                                             "content": {"application/json": {"schema": {"type": "object"}}}}},
            path_name=False)},
        "/api/v1/experiments": {
            "get": {**_operation("List experiments (archived ones only with archived=true).", "read",
                                 {"200": _json(_ref("ExperimentList"), "The experiments, oldest first.")},
                                 ("422",), path_name=False),
                    "parameters": [_ARCHIVED_PARAMETER, _ARMS_PARAMETER]},
            "post": _operation("Create an experiment.", "admin",
                               {"201": _json(_ref("Experiment"), "Created.")}, ("409",),
                               body=_ref("ExperimentCreate"), path_name=False),
        },
        "/api/v1/experiments/{name}": {
            "get": {**_operation("Configuration and state of an experiment.", "read", experiment, ("422",)),
                    "parameters": [_NAME_PARAMETER, _ARMS_PARAMETER]},
            "delete": _operation(
                "Delete an archived experiment and every row of it, in one transaction (409 unless archived). "
                "Its id is never given out again.", "admin",
                {"200": _json(_ref("ExperimentDeleted"), "Deleted; rows deleted per table.")}, ("409",)),
        },
        "/api/v1/experiments/{name}/assign": {"post": _operation(
            "Assign one unit ({unit}) or up to 10,000 ({units}) to arms for the current round (sticky).", "ingest",
            {"200": _json({"oneOf": [_ref("Assignment"), _ref("AssignmentBatch")]},
                          "One assignment, or {assignments: [...]} for a batch.")},
            body={"oneOf": [_ref("AssignOne"), _ref("AssignMany")]})},
        "/api/v1/experiments/{name}/observations": {"post": _operation(
            "Ingest up to 10,000 observations, all or nothing; ids make retries safe.", "ingest",
            {"202": _json(_ref("IngestResult"), "Stored; duplicates were counted before and are ignored.")},
            ("409",), body=_ref("ObservationBatch"))},
        "/api/v1/experiments/{name}/statistics": {"post": _operation(
            "Add a batch of pre-aggregated statistics (count, sum, sum of squares per round, arm and metric; "
            "distinct units per round and arm), all or nothing, exactly once per batch_id.", "ingest",
            {"202": _json(_ref("StatisticsResult"), "Applied: the cells were added to their rounds' statistics."),
             "200": _json(_ref("StatisticsResult"), "A duplicate: this batch_id was applied with the same "
                                                    "content before; nothing was written.")},
            ("409",), body=_ref("StatisticsBatch"))},
        "/api/v1/experiments/{name}/rounds": {
            "get": {**_operation("One page of rounds, oldest first, from since (default 0); limit rounds, by "
                                 "default 200,000 / K (1 to 1,000); next_since is the next page's cursor.", "read",
                                 {"200": _json(_ref("RoundList"), "The rounds.")}, ("422",)),
                    "parameters": [_NAME_PARAMETER, _SINCE_PARAMETER, _LIMIT_PARAMETER, _ARMS_PARAMETER]},
            "post": _operation(
                "Close the current round now and run the update (optionally only if it is round {round}).",
                "admin", {"200": _json(_ref("RoundClosed"), "The new round.")}, ("409", "502"),
                body={"type": "object", "additionalProperties": False,
                      "properties": {"round": {"type": "integer", "minimum": 0}}},
                body_required=False),
        },
        "/api/v1/experiments/{name}/events": {"get": {
            **_operation("One page of the experiment's events (created, paused, resumed, stopped, controller "
                         "started), oldest first, each with its round; next_since is the next page's cursor.",
                         "read", {"200": _json(_ref("ExperimentEventList"), "The events.")}, ("422",)),
            "parameters": [_NAME_PARAMETER, _EVENT_SINCE_PARAMETER, _EVENT_LIMIT_PARAMETER]}},
        "/api/v1/experiments/{name}/diagnostics": {"get": {**_operation(
            "Objective, best mixture and single arm, regret, guardrails, sample-ratio mismatch, late data.",
            "read", {"200": _json(_ref("Diagnostics"), "Diagnostics on the current estimate.")}, ("422",)),
            "parameters": [_NAME_PARAMETER, _ARMS_PARAMETER]}},
        "/api/v1/experiments/{name}/pause": {"post": _operation(
            "Pause: assignment keeps serving the current mixture, rounds stop advancing.", "admin", experiment,
            ("409",))},
        "/api/v1/experiments/{name}/resume": {"post": _operation(
            "Resume a paused experiment; the current round gets a full round_seconds from now.", "admin",
            experiment, ("409",))},
        "/api/v1/experiments/{name}/stop": {"post": _operation(
            "Stop: assignment serves the deployed mixture, ingestion is closed (409).", "admin", experiment,
            ("409",))},
        "/api/v1/experiments/{name}/archive": {"post": _operation(
            "Archive: stop the experiment (if it is not) and leave it out of listings and /metrics; assignment "
            "keeps serving the deployed mixture. Needed before a delete.", "admin", experiment)},
    }


def _ofrep_paths() -> dict[str, Any]:
    """The OpenFeature Remote Evaluation Protocol's two operations (``service.routes.ofrep``), with the
    protocol's operationIds and error shapes (``service.ofrep``)."""
    context = {"content": {"application/json": {"schema": _ref("OfrepEvaluationRequest")}}, "required": True}
    auth = ("401", "403", "429", "503", "413")
    single = _operation("OpenFeature: evaluate one flag (an experiment) for the context's targetingKey (the unit).",
                        "ingest", {
                            "200": _json(_ref("OfrepEvaluationSuccess"), "The arm: value = its params, variant = its "
                                                                    "name, reason SPLIT, metadata = propensity, "
                                                                    "round, mixture_version, segment."),
                            "400": _json(_ref("OfrepEvaluationFailure"), "PARSE_ERROR, TARGETING_KEY_MISSING or "
                                                                    "INVALID_CONTEXT (a missing or unknown segment)."),
                            "404": _json(_ref("OfrepFlagNotFound"), "FLAG_NOT_FOUND: no experiment with this name.")},
                        auth, path_name=False)
    bulk = _operation("OpenFeature: evaluate every experiment not archived for the context's targetingKey.",
                      "ingest", {
                          "200": {**_json(_ref("OfrepBulkEvaluationSuccess"), "One evaluation per experiment, oldest "
                                                                         "first (an INVALID_CONTEXT item for a "
                                                                         "segmented one the context cannot serve)."),
                                  "headers": {"ETag": {"description": "Send it back in If-None-Match: 304 while "
                                                                      "every answer is the same.",
                                                       "schema": {"type": "string"}}}},
                          "304": {"description": "Not modified: the answers are those of the ETag sent."},
                          "400": _json(_ref("OfrepBulkEvaluationFailure"), "PARSE_ERROR, TARGETING_KEY_MISSING or "
                                                                      "INVALID_CONTEXT.")},
                      auth, path_name=False)
    single.update(operationId="evaluateFlag", tags=["OpenFeature (OFREP)"], requestBody=context,
                  parameters=[{"name": "key", "in": "path", "required": True, "description": "The experiment's name.",
                               "schema": {"type": "string"}}])
    bulk.update(operationId="evaluateFlagsBulk", tags=["OpenFeature (OFREP)"], requestBody=context,
                parameters=[{"name": "If-None-Match", "in": "header", "required": False,
                             "description": "The ETag of a previous answer.", "schema": {"type": "string"}}])
    return {"/ofrep/v1/evaluate/flags/{key}": {"post": single}, "/ofrep/v1/evaluate/flags": {"post": bulk}}


#: Operation ids of the operations whose derived id (:func:`_derived_operation_id`) reads worse than a
#: name: generated clients name their methods after them.
_OPERATION_IDS = {
    ("get", "/healthz"): "getHealth",
    ("get", "/metrics"): "getMetrics",
    ("get", "/api/v1/openapi.json"): "getOpenApiDocument",
    ("get", "/api/v1/experiments"): "listExperiments",
    ("post", "/api/v1/experiments"): "createExperiment",
    ("get", "/api/v1/experiments/{name}"): "getExperiment",
    ("delete", "/api/v1/experiments/{name}"): "deleteExperiment",
    ("post", "/api/v1/experiments/{name}/assign"): "assign",
    ("post", "/api/v1/experiments/{name}/observations"): "ingestObservations",
    ("post", "/api/v1/experiments/{name}/statistics"): "ingestStatistics",
    ("get", "/api/v1/experiments/{name}/rounds"): "listRounds",
    ("post", "/api/v1/experiments/{name}/rounds"): "closeRound",
    ("get", "/api/v1/experiments/{name}/events"): "listEvents",
    ("get", "/api/v1/experiments/{name}/diagnostics"): "getDiagnostics",
    ("post", "/api/v1/experiments/{name}/pause"): "pauseExperiment",
    ("post", "/api/v1/experiments/{name}/resume"): "resumeExperiment",
    ("post", "/api/v1/experiments/{name}/stop"): "stopExperiment",
    ("post", "/api/v1/experiments/{name}/archive"): "archiveExperiment",
}
_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def _derived_operation_id(method: str, path: str) -> str:
    """``method`` and the path's literal segments in camelCase, without the version prefix and the
    path parameters: ``GET /api/v1/experiments/{name}/diagnostics`` -> ``getExperimentsDiagnostics``."""
    words = [method]
    for segment in path.strip("/").split("/"):
        if segment.startswith("{") or segment == "api" or re.fullmatch(r"v\d+", segment):
            continue
        words += [word for word in re.split(r"[^A-Za-z0-9]+", segment) if word]
    return words[0] + "".join(word[:1].upper() + word[1:] for word in words[1:])


def _with_operation_ids(paths: dict[str, Any]) -> dict[str, Any]:
    """Every operation gets an ``operationId`` (its own, one of :data:`_OPERATION_IDS`, or derived); a
    duplicate is a programming error."""
    seen: dict[str, tuple[str, str]] = {}
    for path, item in paths.items():
        for method in _METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            operation_id = operation.setdefault(
                "operationId", _OPERATION_IDS.get((method, path)) or _derived_operation_id(method, path))
            if operation_id in seen:
                raise RuntimeError(f"operationId {operation_id!r} of {method.upper()} {path} is also that of "
                                   f"{seen[operation_id][0].upper()} {seen[operation_id][1]}.")
            seen[operation_id] = (method, path)
    return paths


def _strict_property_names(schema: Any) -> Any:
    """A map whose keys pydantic validates (``dict[MetricName, ...]``) comes out as ``patternProperties``
    plus ``propertyNames`` without the pattern, which lets any other key through; the server refuses
    such keys. Published instead as ``propertyNames`` with the pattern (every key must match) and
    ``additionalProperties`` with the value schema: as strict, and what client generators read (they
    ignore ``patternProperties`` and would drop the values)."""
    if isinstance(schema, dict):
        patterns = schema.get("patternProperties")
        if isinstance(patterns, dict) and len(patterns) == 1 and "additionalProperties" not in schema:
            ((pattern, values),) = patterns.items()
            del schema["patternProperties"]
            schema["propertyNames"] = {**schema.get("propertyNames", {}), "pattern": pattern}
            schema["additionalProperties"] = values
        for value in schema.values():
            _strict_property_names(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict_property_names(value)
    return schema


@functools.cache
def _document() -> dict[str, Any]:
    _, generated = models_json_schema(
        [(model, "validation") for model in (schemas.ExperimentCreate, schemas.AssignOne, schemas.AssignMany,
                                             schemas.ObservationBatch, schemas.StatisticsBatch)]
        + [(model, "serialization") for model in responses.MODELS]
        + [(model, "validation") for model in ofrep.REQUEST_MODELS]
        + [(model, "serialization") for model in ofrep.RESPONSE_MODELS],
        ref_template=_REF,
    )
    components = _strict_property_names(generated["$defs"])
    return {
        "openapi": "3.1.0",
        "info": {"title": "pasto controller API", "version": API_VERSION,
                 "description": "Learn a probability mixture over parameter settings (arms) with PASTO."},
        "servers": [{"url": "/"}],
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": components,
        },
        "security": [{"bearerAuth": []}],
        "paths": _with_operation_ids({**_paths(), **_ofrep_paths()}),
    }


def openapi_document() -> dict[str, Any]:
    """A fresh copy of the OpenAPI 3.1 document."""
    return copy.deepcopy(_document())
