"""Path and query parameters are checked before anything reaches the database.

PostgreSQL refuses a NUL character in text (``psycopg.DataError``), Python refuses to parse an
integer of more than 4,300 digits (``ValueError``), and a megabyte-long name would be looked up as
is: each of those used to be a 500. Here:

* every ``<name>``-style path parameter (Werkzeug's default converter, so routes need no change and
  new ones are covered) goes through :class:`PathSegmentConverter`: at most
  :data:`MAX_PATH_SEGMENT` characters (every path parameter is an experiment name), no NUL or other
  control character, else a 404 (no resource can have that name);
* every query parameter, of any route, is refused with a 422 before the view runs when its name or
  value holds a control character or is longer than :data:`MAX_QUERY_VALUE` characters
  (:func:`check_query_strings`);
* integers in the query are read by :func:`query_integer`, which checks the digits and the bounds
  before converting.
"""

from __future__ import annotations

import re

from flask import Flask, request
from werkzeug.exceptions import NotFound
from werkzeug.routing import BaseConverter

from .errors import invalid
from .schemas import MAX_EXPERIMENT_NAME

#: Longest path parameter accepted: every one is an experiment name (a route with another kind of
#: name in its path needs its own converter, or this limit and its message to change).
MAX_PATH_SEGMENT = MAX_EXPERIMENT_NAME
#: Longest query parameter value accepted.
MAX_QUERY_VALUE = 1024
#: Most digits a query integer may have (2**63 has 19): checked before ``int()`` sees the text.
MAX_INTEGER_DIGITS = 19

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PathSegmentConverter(BaseConverter):
    """Werkzeug's default (string) converter with a length limit and no control characters."""

    regex = "[^/]+"

    def to_python(self, value: str) -> str:
        if len(value) > MAX_PATH_SEGMENT:
            raise NotFound(f"Nothing here: an experiment name is at most {MAX_PATH_SEGMENT} characters, "
                           f"this one has {len(value):,}.")
        if _CONTROL.search(value):
            raise NotFound("Nothing here: a name in the path cannot contain NUL or other control characters.")
        return value


def check_query_strings() -> None:
    """``before_request``: refuse control characters and over-long names or values in the query string."""
    if not request.environ.get("QUERY_STRING"):
        return  # most requests (every assign and ingestion call) have none: no need to parse one
    for key, value in request.args.items(multi=True):
        where = f"query.{key[:40]}"
        if _CONTROL.search(key) or _CONTROL.search(value):
            raise invalid(where, "A query parameter cannot contain NUL or other control characters.")
        if len(key) > MAX_QUERY_VALUE or len(value) > MAX_QUERY_VALUE:
            raise invalid(where, f"A query parameter is at most {MAX_QUERY_VALUE} characters long.")


def query_integer(name: str, default: int | None, minimum: int, maximum: int | None = None) -> int | None:
    """The query parameter ``name`` as an integer in ``[minimum, maximum]``; ``default`` when absent.

    A 422 naming the parameter when it is not a plain decimal integer (ASCII digits only:
    ``str.isdigit`` is also true for "²") or is out of bounds; the digits are counted before
    ``int()`` runs, so a 5,000-digit number is refused like any other out-of-range value.
    """
    text = request.args.get(name)
    if text is None:
        return default
    bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
    shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"
    if not (text.isascii() and text.isdigit()):
        raise invalid(name, f"Must be an integer {bounds}, got {shown!r}.")
    if len(text.lstrip("0")) > MAX_INTEGER_DIGITS:
        raise invalid(name, f"Must be an integer {bounds}, got a number of {len(text):,} digits.")
    number = int(text)
    if number < minimum or (maximum is not None and number > maximum):
        raise invalid(name, f"Must be an integer {bounds}, got {shown!r}.")
    return number


def query_flag(name: str, default: bool) -> bool:
    """The query parameter ``name`` as a boolean (``true`` or ``false``); ``default`` when absent,
    a 422 naming the parameter otherwise."""
    text = request.args.get(name)
    if text is None:
        return default
    if text in ("true", "false"):
        return text == "true"
    shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"
    raise invalid(name, f"Must be true or false, got {shown!r}.")


def init_app(app: Flask) -> None:
    """Install the path converter (before any route is added) and the query check."""
    app.url_map.converters["default"] = PathSegmentConverter
    app.url_map.converters["string"] = PathSegmentConverter
    app.before_request(check_query_strings)
