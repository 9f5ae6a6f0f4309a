"""Auth on every mutating route, on SQLite, PostgreSQL and a real HTTP server; token checks that are
timing-safe; tokens stored only as SHA-256 digests.

``tests/service/test_auth.py`` has the route x role matrix on SQLite through the test client. This
module adds what it lacks and stays consistent with it:

* the mutating routes are read from ``app.url_map`` (every method but GET/HEAD/OPTIONS), so a route
  added later is refused here until it is given a role; their roles agree with that matrix and with
  the ``require_role`` of each view;
* every mutating route answers 401 without a token and with each kind of bad token (unknown,
  same length as a valid one, the stored digest itself, wrong scheme), and 403 with each lower role,
  on SQLite and on PostgreSQL (``backend_api``) and over real HTTP, and a refused request changes
  nothing in the database;
* a token check goes through ``hmac.compare_digest`` on SHA-256 hex digests (spied), and only the
  digest ever reaches the database (SQL parameters recorded);
* the ``tokens`` table, read directly, holds in no column any plaintext token (stored, created by
  ``pasto tokens create``, or the bootstrap ``PASTO_ADMIN_TOKEN``); each stored hash is the SHA-256
  hex of its token; no table and no byte of the SQLite files holds a plaintext token, and the
  authenticator keeps only the bootstrap token's digest.
"""

from __future__ import annotations

import hashlib
import re
import types
from pathlib import Path
from typing import Any

import pytest
import requests
import sqlalchemy as sa

import service.auth
from pasto.cli import main as pasto_main
from service.db import get_db
# The fixtures of the service tests, shared rather than copied (tests/reliability has its own conftest).
from tests.service.conftest import (  # noqa: F401
    ADMIN_TOKEN, api, app, app_factory, backend_api, backend_url, serve, setup_a_body, sqlite_url, tokens,
)
from tests.service.test_auth import ROUTES as SERVICE_AUTH_MATRIX
from tests.service.test_auth import rule_of

ROLES = ("read", "ingest", "admin")
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
NAME = "setup-a"

#: Minimum role of every mutating route (Flask rule syntax). A route missing here fails
#: ``test_every_mutating_route_has_a_role_here_in_the_view_and_in_the_service_matrix``.
MUTATING_ROLES = {
    ("POST", "/api/v1/experiments"): "admin",
    ("POST", "/api/v1/experiments/<name>/assign"): "ingest",
    ("POST", "/api/v1/experiments/<name>/observations"): "ingest",
    ("POST", "/api/v1/experiments/<name>/rounds"): "admin",
    ("POST", "/api/v1/experiments/<name>/pause"): "admin",
    ("POST", "/api/v1/experiments/<name>/resume"): "admin",
    ("POST", "/api/v1/experiments/<name>/stop"): "admin",
    ("POST", "/api/v1/experiments/<name>/archive"): "admin",
    ("DELETE", "/api/v1/experiments/<name>"): "admin",
    ("POST", "/api/v1/experiments/<name>/statistics"): "ingest",
    ("POST", "/ofrep/v1/evaluate/flags/<key>"): "ingest",
    ("POST", "/ofrep/v1/evaluate/flags"): "ingest",
}

#: A body each route would accept, so that a refusal can only be the token's doing.
VALID_BODIES = {
    "/api/v1/experiments": setup_a_body("created-by-a-refused-token"),
    "/api/v1/experiments/<name>/assign": {"unit": "u-1"},
    "/api/v1/experiments/<name>/observations": {
        "observations": [{"id": "o-1", "unit": "u-1", "round": 0, "values": {"x": 1.0, "y": 0.5}}]},
    "/api/v1/experiments/<name>/rounds": {"round": 0},
    "/api/v1/experiments/<name>/statistics": {"batch_id": "b-1", "cells": [
        {"round": 0, "arm": "a", "metric": "x", "count": 1, "sum": 1.0, "sum_of_squares": 1.0}]},
    "/ofrep/v1/evaluate/flags/<key>": {"context": {"targetingKey": "u-1"}},
    "/ofrep/v1/evaluate/flags": {"context": {"targetingKey": "u-1"}},
}


def mutating_routes(app) -> list[tuple[str, str]]:
    """(method, Flask rule) of every route that accepts a method other than GET/HEAD/OPTIONS."""
    return sorted((method, rule.rule) for rule in app.url_map.iter_rules()
                  for method in rule.methods - SAFE_METHODS)


def sha256_hex(token: str) -> str:
    """Computed here rather than with ``service.auth.hash_token``, so a change there is noticed."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def bad_authorizations(tokens: dict[str, str]) -> dict[str, str]:
    """Authorization headers that must all be refused with 401, by what is wrong with them."""
    admin = tokens["admin"]
    near_miss = admin[:-1] + ("A" if admin[-1] != "A" else "B")
    bootstrap_near_miss = ADMIN_TOKEN[:-1] + ("x" if ADMIN_TOKEN[-1] != "x" else "y")
    return {
        "unknown token": "Bearer not-a-token",
        "same length as the admin token, last character changed": f"Bearer {near_miss}",
        "same length as the bootstrap token, last character changed": f"Bearer {bootstrap_near_miss}",
        "the admin token with one more character": f"Bearer {admin}x",
        "the admin token without its last character": f"Bearer {admin[:-1]}",
        "the stored digest of the admin token": f"Bearer {sha256_hex(admin)}",
        "the digest of the bootstrap token": f"Bearer {sha256_hex(ADMIN_TOKEN)}",
        "the admin token under another scheme": f"Token {admin}",
        "Basic credentials": "Basic dXNlcjpwYXNz",
        "an empty bearer": "Bearer ",
    }


def database_state(app) -> dict[str, Any]:
    """What a refused request must leave alone."""
    with get_db(app).engine.connect() as connection:
        def rows(sql: str) -> list[tuple]:
            return [tuple(row) for row in connection.exec_driver_sql(sql)]

        return {
            "experiments": rows("SELECT name, status, round_index, applied_rounds, version FROM experiments"),
            "rounds": rows("SELECT count(*) FROM rounds"),
            "tokens": rows("SELECT count(*) FROM tokens"),
            **{table: rows(f"SELECT count(*) FROM {table}")
               for table in ("observation_ids", "round_statistics", "arm_round_counts", "round_units")},
        }


def refusal_problems(send, routes: list[tuple[str, str]], tokens: dict[str, str]) -> list[str]:
    """Send every refused combination; return what went wrong (empty when every answer was right).

    ``send(method, path, headers, body)`` returns ``(status, json, headers)``.
    """
    problems = []
    for method, rule in routes:
        role = MUTATING_ROLES.get((method, rule))
        if role is None:
            problems.append(f"{method} {rule} has no role in MUTATING_ROLES")
            continue
        path = rule.replace("<name>", NAME).replace("<key>", NAME)
        body = VALID_BODIES.get(rule)
        attempts = [("no Authorization header", {}, 401)]
        attempts += [(why, {"Authorization": header}, 401) for why, header in bad_authorizations(tokens).items()]
        attempts += [(f"a {lower} token", {"Authorization": f"Bearer {tokens[lower]}"}, 403)
                     for lower in ROLES[:ROLES.index(role)]]
        for why, headers, expected in attempts:
            status, answer, response_headers = send(method, path, headers, body)
            code = (answer or {}).get("error", {}).get("code")
            wanted_code = "unauthorized" if expected == 401 else "forbidden"
            if status != expected or code != wanted_code:
                problems.append(f"{method} {path} with {why}: {status} {str(answer)[:200]}, expected {expected}")
            elif expected == 401 and not response_headers.get("WWW-Authenticate", "").startswith("Bearer"):
                problems.append(f"{method} {path} with {why}: 401 without a Bearer WWW-Authenticate")
            elif expected == 403 and repr(role) not in answer["error"]["message"]:
                problems.append(f"{method} {path} with {why}: the 403 does not name the {role!r} role")
    return problems


# ====================================================================== which routes, which roles
def test_every_mutating_route_has_a_role_here_in_the_view_and_in_the_service_matrix(app):
    routes = mutating_routes(app)
    assert set(routes) == set(MUTATING_ROLES), "a mutating route was added or removed: give it a role here"
    endpoints = {(method, rule.rule): rule.endpoint for rule in app.url_map.iter_rules() for method in rule.methods}
    service_matrix = {(method, rule_of(path)): role for method, path, role, _ in SERVICE_AUTH_MATRIX}
    for route, role in MUTATING_ROLES.items():
        view = app.view_functions[endpoints[route]]
        assert getattr(view, "required_role", None) == role, f"{route}: the view requires " \
                                                              f"{getattr(view, 'required_role', None)!r}"
        assert service_matrix.get(route) == role, f"{route}: tests/service/test_auth.py says {service_matrix.get(route)}"


# ====================================================================== refusals, both backends and real HTTP
def test_mutating_routes_refuse_missing_bad_and_lower_tokens(backend_api):
    """On SQLite and PostgreSQL (the token lookup is a query on each), through the test client."""
    api = backend_api
    app = api.client.application
    app.config["PASTO_AUTH_FAILURE_LIMIT"] = 1_000_000  # every kind of bad token, many times: not throttled here
    assert api("POST", "/api/v1/experiments", json=setup_a_body(NAME)).status_code == 201
    before = database_state(app)

    def send(method, path, headers, body):
        response = api.client.open(path, method=method, headers=headers, json=body)
        return response.status_code, response.get_json(silent=True), response.headers

    problems = refusal_problems(send, mutating_routes(app), api.tokens)
    assert not problems, "\n".join(problems)
    assert database_state(app) == before, "a refused request changed the database"
    # The tokens are good ones: the same requests with enough role go through.
    assert api("POST", f"/api/v1/experiments/{NAME}/pause", role="admin").status_code == 200
    assert api("POST", f"/api/v1/experiments/{NAME}/assign", role="ingest", json={"unit": "u"}).status_code == 200


def test_mutating_routes_refuse_missing_bad_and_lower_tokens_over_real_http(tmp_path, tokens_of, serve):  # noqa: F811
    app, tokens = tokens_of(f"sqlite:///{tmp_path / 'pasto.sqlite'}")
    app.config["PASTO_AUTH_FAILURE_LIMIT"] = 1_000_000  # every kind of bad token, many times: not throttled here
    base = serve(app)
    session = requests.Session()
    created = session.post(f"{base}/api/v1/experiments", json=setup_a_body(NAME), timeout=30,
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert created.status_code == 201
    before = database_state(app)

    def send(method, path, headers, body):
        response = session.request(method, base + path, headers=headers, json=body, timeout=30)
        return response.status_code, response.json(), response.headers

    problems = refusal_problems(send, mutating_routes(app), tokens)
    assert not problems, "\n".join(problems)
    assert database_state(app) == before, "a refused request changed the database"
    response = session.post(f"{base}/api/v1/experiments/{NAME}/stop", timeout=30,
                            headers={"Authorization": f"Bearer {tokens['admin']}"})
    assert response.status_code == 200


@pytest.fixture
def tokens_of(app_factory):
    """``tokens_of(database_url)``: a migrated app and a stored token per role."""
    from service.auth import create_token

    apps = []

    def build(database_url: str):
        application = app_factory(database_url)
        apps.append(application)
        with get_db(application).write() as session:
            return application, {role: create_token(session, role, f"auth-{role}") for role in ROLES}

    yield build
    for application in apps:
        get_db(application).engine.dispose()


# ====================================================================== timing-safe comparison
@pytest.fixture
def compare_digest_calls(monkeypatch) -> list[tuple[Any, Any]]:
    """Every call ``service.auth`` makes to ``hmac.compare_digest`` (which still does the work)."""
    calls: list[tuple[Any, Any]] = []
    real = service.auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(service.auth, "hmac", types.SimpleNamespace(compare_digest=spy))
    return calls


@pytest.fixture
def sql_parameters(app) -> list[str]:
    """The text of the parameters of every SQL statement the app's engine runs."""
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        seen.append(repr(parameters))

    engine = get_db(app).engine
    sa.event.listen(engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(engine, "before_cursor_execute", record)


HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def test_stored_token_is_checked_with_compare_digest_on_digests(api, compare_digest_calls, sql_parameters):
    token = api.tokens["ingest"]
    response = api("POST", "/api/v1/experiments", role="ingest", json=setup_a_body())
    assert response.status_code == 403  # authenticated as ingest, which is not enough
    assert (sha256_hex(token), sha256_hex(token)) in compare_digest_calls, compare_digest_calls
    for a, b in compare_digest_calls:  # digests, never the token itself
        assert HEX_DIGEST.match(a) and HEX_DIGEST.match(b), (a, b)
    assert not any(token in parameters for parameters in sql_parameters), "the plaintext token reached SQL"
    assert any(sha256_hex(token) in parameters for parameters in sql_parameters)


def test_bootstrap_token_is_checked_with_compare_digest(api, compare_digest_calls):
    response = api("POST", "/api/v1/experiments", role=None, json=setup_a_body(),
                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 201
    assert compare_digest_calls == [(sha256_hex(ADMIN_TOKEN), sha256_hex(ADMIN_TOKEN))]


@pytest.mark.parametrize("which", ["stored admin token", "bootstrap token"])
def test_unknown_token_of_the_same_length_is_refused_after_a_digest_comparison(api, compare_digest_calls,
                                                                               which):
    valid = api.tokens["admin"] if which == "stored admin token" else ADMIN_TOKEN
    # Used once first, so the valid token sits in the per-process cache next to the impostor.
    assert api("GET", "/api/v1/experiments", role=None, headers={"Authorization": f"Bearer {valid}"}).status_code == 200
    impostor = valid[:-1] + ("0" if valid[-1] != "0" else "1")
    assert len(impostor) == len(valid) and impostor != valid
    compare_digest_calls.clear()
    response = api("POST", "/api/v1/experiments", role=None, json=setup_a_body(),
                   headers={"Authorization": f"Bearer {impostor}"})
    assert response.status_code == 401
    assert response.get_json()["error"]["message"] == "The bearer token is not valid."
    # It was compared as a digest with the bootstrap token's digest, like every token.
    assert (sha256_hex(impostor), sha256_hex(ADMIN_TOKEN)) in compare_digest_calls


# ====================================================================== tokens stored hashed
def test_tokens_are_stored_only_as_sha256_digests(backend_api, monkeypatch, capsys):
    """Stored tokens, one from ``pasto tokens create``, and the bootstrap token, after all were used."""
    api = backend_api
    app = api.client.application
    engine = get_db(app).engine
    monkeypatch.setenv("PASTO_DATABASE_URL", engine.url.render_as_string(hide_password=False))
    monkeypatch.setenv("PASTO_ADMIN_TOKEN", ADMIN_TOKEN)
    assert pasto_main(["tokens", "create", "--role", "ingest", "--name", "from-the-cli"]) == 0
    cli_token = capsys.readouterr().out.strip().splitlines()[-1]
    tokens = {**{f"stored {role}": token for role, token in api.tokens.items()}, "cli ingest": cli_token}
    for token in tokens.values():  # every token works, so each was really stored (or checked) somehow
        assert api("GET", "/api/v1/experiments", role=None, headers={"Authorization": f"Bearer {token}"}).status_code \
            == 200
    assert api("POST", "/api/v1/experiments", role=None, json=setup_a_body(),
               headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 201
    plaintexts = {**tokens, "bootstrap": ADMIN_TOKEN}

    with engine.connect() as connection:
        result = connection.exec_driver_sql("SELECT * FROM tokens")
        columns = list(result.keys())
        rows = [dict(zip(columns, row)) for row in result]
    assert len(rows) == len(tokens)
    for row in rows:
        for column, value in row.items():
            for label, token in plaintexts.items():
                assert token not in str(value), f"the {label} token is in column {column} of the tokens table"
        assert HEX_DIGEST.match(row["token_hash"]), row
    by_hash = {row["token_hash"]: row for row in rows}
    for label, token in tokens.items():
        assert sha256_hex(token) in by_hash, f"the {label} token is not stored as its SHA-256 hex digest"
        assert by_hash[sha256_hex(token)]["role"] == label.split()[-1]
    assert sha256_hex(ADMIN_TOKEN) not in by_hash, "the bootstrap token was stored"

    # No table anywhere holds a plaintext token; the authenticator keeps the bootstrap one as a digest.
    metadata = sa.MetaData()
    metadata.reflect(engine)
    with engine.connect() as connection:
        for table in metadata.sorted_tables:
            for row in connection.execute(sa.select(table)):
                text = repr(tuple(row))
                for label, token in plaintexts.items():
                    assert token not in text, f"the {label} token is in table {table.name}"
    authenticator = app.extensions["pasto.auth"]
    assert authenticator.admin_digest == sha256_hex(ADMIN_TOKEN)
    assert ADMIN_TOKEN not in repr(vars(authenticator))

    if engine.dialect.name == "sqlite":  # the bytes on disk, WAL included
        database = Path(engine.url.database)
        engine.dispose()
        files = [path for path in database.parent.iterdir() if path.name.startswith(database.name)]
        assert database in files
        for path in files:
            content = path.read_bytes()
            for label, token in plaintexts.items():
                assert token.encode() not in content, f"the {label} token is in {path.name}"
