"""Every path and query parameter of every route, given a NUL, a huge integer and an over-long value,
answers a 4xx JSON error (never a 5xx) on SQLite and PostgreSQL.

The cases are generated from the application's own ``url_map`` (every rule and method, so a new
route is covered without editing this file) and, for query parameters, from the OpenAPI document's
``in: query`` parameters of that operation plus one undocumented name (the query check applies to
any parameter). Requests carry the admin token, so they get past authentication and would reach the
database if nothing stopped them, and path parameters not under test name a real, running
experiment.
"""

from __future__ import annotations

import urllib.parse

import pytest

from service.db import get_db
from service.openapi import openapi_document
from tests.service.conftest import ADMIN_TOKEN, backend_url, make_app, setup_a_body  # noqa: F401 (fixture)

LIVE = "live"
BAD_VALUES = {
    "nul": "x\x00",
    "nul-only": "\x00",
    "huge-integer": "9" * 5000,
    "over-long": "a" * 5000,
}
UNDOCUMENTED_QUERY = "anything"


def _cases(app) -> list[tuple[str, str, str]]:
    """(method, URL, what) for every route, method, parameter and bad value."""
    documented = openapi_document()["paths"]
    cases = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        template = rule.rule.replace("<", "{").replace(">", "}")
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            operation = documented.get(template, {}).get(method.lower(), {})
            query_names = [parameter["name"] for parameter in operation.get("parameters", [])
                           if parameter.get("in") == "query"] + [UNDOCUMENTED_QUERY]
            valid_path = rule.rule
            for argument in rule.arguments:
                valid_path = valid_path.replace(f"<{argument}>", LIVE)
            for label, value in BAD_VALUES.items():
                for argument in rule.arguments:
                    path = rule.rule
                    for other in rule.arguments:
                        path = path.replace(f"<{other}>", urllib.parse.quote(value, safe="") if other == argument
                                            else LIVE)
                    cases.append((method, path, f"{method} {rule.rule} path {argument}={label}"))
                for name in query_names:
                    query = urllib.parse.urlencode({name: value})
                    cases.append((method, f"{valid_path}?{query}", f"{method} {rule.rule} query {name}={label}"))
    return cases


def test_bad_path_and_query_parameters_are_4xx_on_every_route(backend_url):  # noqa: F811
    app = make_app(backend_url)
    try:
        client = app.test_client()
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        created = client.post("/api/v1/experiments", json=setup_a_body(LIVE), headers=headers)
        assert created.status_code == 201, created.get_data(as_text=True)

        cases = _cases(app)
        routes = {what.split(" path ")[0].split(" query ")[0] for _, _, what in cases}
        assert len(routes) >= 15, routes  # every operation of the service, not a shrunken map
        assert any(" path name=nul" in what for _, _, what in cases)
        assert any(" query since=huge-integer" in what for _, _, what in cases)
        assert any("GET /api/v1/experiments/<name>/diagnostics query arms=huge-integer" in what for _, _, what in cases)
        failures = []
        for method, url, what in cases:
            response = client.open(url, method=method, json={}, headers=headers)
            if response.status_code >= 500 or response.status_code < 400:
                failures.append(f"{what}: {response.status_code} {response.get_data(as_text=True)[:200]}")
            elif response.is_json:
                error = response.get_json()["error"]
                assert error["code"] and error["message"], what
        assert not failures, "\n".join(failures)

        # The experiment is untouched (no bad request paused or stopped it) and still served.
        state = client.get(f"/api/v1/experiments/{LIVE}", headers=headers)
        assert state.status_code == 200 and state.get_json()["status"] == "running"
    finally:
        get_db(app).engine.dispose()


@pytest.mark.parametrize("query, message", [
    ("since=" + "9" * 1000, "1,000 digits"),  # under the 1,024-character limit of any query value
    ("since=" + "9" * 5000, "at most 1024 characters"),
    ("since=%00", "control characters"),
    ("limit=0", "between 1 and 1000"),
    ("limit=2", None),
], ids=["1000-digits", "5000-digits", "nul", "zero", "valid"])
def test_query_integers_are_checked_before_conversion(backend_url, query, message):  # noqa: F811
    app = make_app(backend_url)
    try:
        client = app.test_client()
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert client.post("/api/v1/experiments", json=setup_a_body(LIVE), headers=headers).status_code == 201
        response = client.get(f"/api/v1/experiments/{LIVE}/rounds?{query}", headers=headers)
        if message is None:
            assert response.status_code == 200
        else:
            assert response.status_code == 422, response.get_data(as_text=True)
            assert message in response.get_json()["error"]["message"]
    finally:
        get_db(app).engine.dispose()
