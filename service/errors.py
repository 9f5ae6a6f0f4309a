"""The single JSON error format: ``{"error": {"code": str, "message": str, "details": ...}}``.

Every error leaves the service through :func:`error_response`, including werkzeug's HTTP errors
(404, 405, 413, ...) and unexpected exceptions (500), so clients only ever parse one shape.

A database that is down, stalled, locked or out of connections (``service.db.is_unavailable_error``)
is not a server bug: it is answered 503 ``database_unavailable`` with ``Retry-After``, and logged once
per outage by ``service.db.DatabaseStatus`` instead of one traceback per request.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from flask import Flask, Response, current_app, jsonify, request
from pydantic import ValidationError
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error with an HTTP status, a stable machine-readable code and a sentence for humans."""

    def __init__(self, status: int, code: str, message: str, details: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.headers = headers or {}


def error_response(status: int, code: str, message: str, details: Any = None) -> Response:
    response = jsonify({"error": {"code": code, "message": message, "details": details}})
    response.status_code = status
    return response


def format_location(location: tuple[Any, ...] | list[Any]) -> str:
    """``("observations", 3, "values", "x")`` -> ``"observations[3].values.x"``."""
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "body"


MAX_DETAILS = 100  # a 10,000-item batch that is wrong throughout still gets a small answer


def validation_problems(error: ValidationError) -> list[tuple[tuple[Any, ...], str]]:
    """Every problem pydantic found, as (location path, full-sentence message), in its order."""
    return [(tuple(item["loc"]), _sentence(item["msg"].removeprefix("Value error, ")))
            for item in error.errors(include_url=False, include_input=False, include_context=False)]


def validation_error(error: ValidationError, prefix: tuple[Any, ...] = ()) -> ApiError:
    """A 422 :class:`ApiError` listing every problem pydantic found, each with where it is."""
    return problems_error([{"location": format_location((*prefix, *location)), "message": message}
                           for location, message in validation_problems(error)])


def body_order(data: Any, location: tuple[Any, ...]) -> tuple[int, ...]:
    """Where ``location`` is in the decoded JSON ``data``, as positions (list index, rank of a key in
    its object): sorting problems by it lists them in the order of the request body. A part that is
    not in the body (a missing field) sorts after everything present at its level."""
    key: list[int] = []
    node = data
    for part in location:
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            key.append(part)
            node = node[part]
        elif isinstance(node, dict) and part in node:
            key.append(list(node).index(part))
            node = node[part]
        else:
            key.append(len(node) if isinstance(node, (list, dict)) else 0)
            node = None
    return tuple(key)


def problems_error(problems: list[dict[str, str]]) -> ApiError:
    """A 422 for offending items (``{"location": ..., "message": ...}``, at least one, in body order):
    the first in the message, and up to :data:`MAX_DETAILS` of them in ``details``."""
    first = problems[0]
    more = ""
    others = len(problems) - 1
    if len(problems) > MAX_DETAILS:
        more = f" ({others} more problems; details lists the first {MAX_DETAILS})"
    elif others:
        more = f" ({others} more {'problem' if others == 1 else 'problems'} in details)"
    return ApiError(422, "invalid_request", f"{first['location']}: {first['message']}{more}",
                    problems[:MAX_DETAILS])


def invalid(location: str, message: str) -> ApiError:
    """A 422 for one offending item, named by its location in the request body."""
    return problems_error([{"location": location, "message": message}])


def _sentence(message: str) -> str:
    message = message[:1].upper() + message[1:]
    return message if message.endswith(".") else message + "."


def _code_for(exception: HTTPException) -> str:
    return re.sub(r"[^a-z0-9]+", "_", (exception.name or "error").lower()).strip("_")


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def handle_api_error(error: ApiError):
        response = error_response(error.status, error.code, error.message, error.details)
        response.headers.update(error.headers)
        if error.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="pasto"'
        return response

    @app.errorhandler(HTTPException)
    def handle_http_exception(error: HTTPException):
        details = None
        if error.code == 405 and getattr(error, "valid_methods", None):
            details = {"allowed_methods": sorted(error.valid_methods)}
        message = error.description or error.name
        limit = request.max_content_length
        if error.code == 413 and limit is not None:
            message = (f"The request body is larger than the {limit:,} bytes this server accepts "
                       "(PASTO_MAX_CONTENT_LENGTH); send it in smaller batches.")
            details = {"max_content_length": limit}
        response = error_response(error.code or 500, _code_for(error), message, details)
        if error.code == 405 and getattr(error, "valid_methods", None):
            response.headers["Allow"] = ", ".join(sorted(error.valid_methods))
        return response

    @app.errorhandler(Exception)
    def handle_unexpected(error: Exception):
        from .db import get_db, is_unavailable_error

        if is_unavailable_error(error):
            get_db().status.failed(error)
            return database_unavailable()
        log.exception("Unhandled error while serving a request")
        return error_response(500, "internal_error", "The server failed to handle the request; see its log.")


def database_unavailable() -> Response:
    """503 ``database_unavailable`` with ``Retry-After`` (``PASTO_DATABASE_RETRY_AFTER`` seconds)."""
    retry_after = current_app.config["PASTO_DATABASE_RETRY_AFTER"]
    response = error_response(
        503, "database_unavailable",
        f"The database is unavailable (down, unreachable or overloaded); retry in {retry_after} s.",
        {"retry_after_seconds": retry_after})
    response.headers["Retry-After"] = str(retry_after)
    return response
