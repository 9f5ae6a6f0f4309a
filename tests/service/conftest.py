"""Fixtures for the service tests: a migrated SQLite (or PostgreSQL) database, tokens, a live server."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server

from tests.migrated import upgrade_to_head
from service import create_app
from service.auth import create_token
from service.db import get_db

ADMIN_TOKEN = "bootstrap-admin-token-for-tests"


def setup_a_body(name: str = "setup-a", **overrides: Any) -> dict[str, Any]:
    """The paper's setup A as an experiment: arms x/y means [[2, 0], [-2, 2]], guardrail y >= 0."""
    body = {
        "name": name,
        "arms": [{"name": "a", "params": {"weight": 1.0}}, {"name": "b", "params": {"weight": 0.0}}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "round_seconds": 3600,
        "seed": 7,
    }
    body.update(overrides)
    return body


def make_app(database_url: str, **config: Any):
    upgrade_to_head(database_url)
    return create_app({"PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": ADMIN_TOKEN,
                       "TESTING": True, **config})


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'pasto.sqlite'}"


@pytest.fixture
def app(sqlite_url):
    application = make_app(sqlite_url)
    yield application
    get_db(application).engine.dispose()


@pytest.fixture
def tokens(app) -> dict[str, str]:
    """A token per role (``admin`` is a stored token, not the bootstrap one)."""
    with get_db(app).write() as session:
        return {role: create_token(session, role, f"test-{role}") for role in ("read", "ingest", "admin")}


class Api:
    """The Flask test client with bearer tokens by role."""

    def __init__(self, client, tokens: dict[str, str]) -> None:
        self.client = client
        self.tokens = tokens

    def __call__(self, method: str, path: str, role: str | None = "admin", **kwargs):
        headers = dict(kwargs.pop("headers", {}))
        if role is not None:
            headers["Authorization"] = f"Bearer {self.tokens[role]}"
        return self.client.open(path, method=method, headers=headers, **kwargs)


@pytest.fixture
def api(app, tokens) -> Api:
    return Api(app.test_client(), tokens)


@pytest.fixture
def serve() -> Iterator[Callable]:
    """``serve(app)`` runs ``app`` on a real threaded HTTP server on 127.0.0.1; returns its base URL."""
    servers = []

    def start(application) -> str:
        server = make_server("127.0.0.1", 0, application, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server, thread in servers:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


@pytest.fixture
def setup_a():
    """``setup_a(name="setup-a", **overrides)``: the request body of a setup-A experiment."""
    return setup_a_body


@pytest.fixture
def admin_token() -> str:
    return ADMIN_TOKEN


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend_url(request, tmp_path) -> str:
    """A fresh database URL on each backend (PostgreSQL tests are marked ``postgres``)."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path / 'pasto.sqlite'}"


@pytest.fixture
def backend_api(backend_url):
    """An :class:`Api` on a migrated database of each backend."""
    application = make_app(backend_url)
    with get_db(application).write() as session:
        role_tokens = {role: create_token(session, role, f"test-{role}") for role in ("read", "ingest", "admin")}
    yield Api(application.test_client(), role_tokens)
    get_db(application).engine.dispose()


@pytest.fixture
def app_factory():
    """``app_factory(database_url, **config)``: migrate the database and create an app on it."""
    return make_app
