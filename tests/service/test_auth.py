"""Auth matrix: every route x every role; 401 without or with a bad token, 403 with a lower role."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from service.auth import hash_token
from service.db import get_db
from service.models import Token

ROLES = ("read", "ingest", "admin")
ADMIN_TOKEN = "bootstrap-admin-token-for-tests"  # conftest.ADMIN_TOKEN


def setup_a_body(name: str = "setup-a") -> dict:
    return {
        "name": name, "arms": [{"name": "a", "params": {}}, {"name": "b", "params": {}}], "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "round_seconds": 3600,
    }
OBSERVATION = {"observations": [{"id": "o1", "unit": "u1", "round": 0, "values": {"x": 1.0}}]}

# (method, path, minimum role, JSON body)
ROUTES = [
    ("GET", "/api/v1/experiments", "read", None),
    ("POST", "/api/v1/experiments", "admin", setup_a_body("other")),
    ("GET", "/api/v1/experiments/setup-a", "read", None),
    ("POST", "/api/v1/experiments/setup-a/assign", "ingest", {"unit": "u1"}),
    ("POST", "/api/v1/experiments/setup-a/observations", "ingest", OBSERVATION),
    ("POST", "/api/v1/experiments/setup-a/statistics", "ingest",
     {"batch_id": "b-1", "cells": [{"round": 0, "arm": "a", "metric": "x", "count": 1, "sum": 1.0, "sum_of_squares": 1.0}]}),
    ("GET", "/api/v1/experiments/setup-a/rounds", "read", None),
    ("POST", "/api/v1/experiments/setup-a/rounds", "admin", None),
    ("GET", "/api/v1/experiments/setup-a/diagnostics", "read", None),
    ("GET", "/api/v1/experiments/setup-a/events", "read", None),
    ("POST", "/api/v1/experiments/setup-a/pause", "admin", None),
    ("POST", "/api/v1/experiments/setup-a/resume", "admin", None),
    ("POST", "/api/v1/experiments/setup-a/stop", "admin", None),
    ("POST", "/api/v1/experiments/setup-a/archive", "admin", None),
    ("DELETE", "/api/v1/experiments/setup-a", "admin", None),  # 409 for the admin: not archived
    ("POST", "/ofrep/v1/evaluate/flags/setup-a", "ingest", {"context": {"targetingKey": "u1"}}),
    ("POST", "/ofrep/v1/evaluate/flags", "ingest", {"context": {"targetingKey": "u1"}}),
]
PUBLIC = [("GET", "/healthz"), ("GET", "/api/v1/openapi.json")]


def rule_of(path: str) -> str:
    """The Flask rule of a path of the matrix (the experiment is <name> in the API, <key> in OFREP)."""
    return path.replace("setup-a", "<key>" if path.startswith("/ofrep/") else "<name>")


def test_the_matrix_covers_every_api_route(app):
    documented = {(method, rule_of(path)) for method, path, _, _ in ROUTES} | set(PUBLIC)
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.endpoint.split(".")[0] == "dashboard" or rule.rule == "/metrics":
            continue
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert (method, rule.rule) in documented, f"{method} {rule.rule} is missing from the auth matrix"


@pytest.mark.parametrize("method, path, role, body", ROUTES, ids=[f"{m} {p}" for m, p, _, _ in ROUTES])
def test_route_roles(api, method, path, role, body):
    assert api("POST", "/api/v1/experiments", json=setup_a_body()).status_code == 201
    kwargs = {} if body is None else {"json": body}

    missing = api(method, path, role=None, **kwargs)
    assert missing.status_code == 401
    assert missing.get_json()["error"]["code"] == "unauthorized"
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")

    for header in ("Bearer not-a-token", "Basic dXNlcjpwYXNz", "Bearer", "bearer  "):
        response = api(method, path, role=None, headers={"Authorization": header}, **kwargs)
        assert response.status_code == 401, header

    for lower in ROLES[: ROLES.index(role)]:
        response = api(method, path, role=lower, **kwargs)
        assert response.status_code == 403, lower
        assert response.get_json()["error"]["code"] == "forbidden"

    for allowed in ROLES[ROLES.index(role):]:
        response = api(method, path, role=allowed, **kwargs)
        assert response.status_code < 400 or response.status_code == 409, (allowed, response.get_json())


def test_bootstrap_admin_token(api):
    response = api("GET", "/api/v1/experiments", role=None, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 200
    response = api("POST", "/api/v1/experiments", role=None, json=setup_a_body(),
                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 201


@pytest.mark.parametrize("method, path", PUBLIC)
def test_public_routes_need_no_token(api, method, path):
    assert api(method, path, role=None).status_code == 200


def test_tokens_are_stored_hashed(app, tokens):
    with get_db(app).read() as session:
        stored = session.execute(sa.select(Token.token_hash, Token.role)).all()
    hashes = {row.token_hash for row in stored}
    for token in tokens.values():
        assert token not in hashes
        assert hash_token(token) in hashes
    assert all(len(row.token_hash) == 64 for row in stored)
    assert ADMIN_TOKEN not in hashes and hash_token(ADMIN_TOKEN) not in hashes
