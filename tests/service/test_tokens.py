"""Token lifecycle in one process: expiry, revocation, rotation, the CLI's durations, and the admin
token's strength check at start. (Several workers and the CLI as its own process:
``tests/reliability/test_token_lifecycle.py``.)"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from service import auth, store
from service.auth import TOKEN_CACHE_SECONDS, admin_token_weakness, create_token, revoke_tokens, rotate_token
from service.cli import _duration
from service.db import get_db

from .conftest import make_app

LIST = "/api/v1/experiments"


def status(client, token: str) -> int:
    return client.get(LIST, headers={"Authorization": f"Bearer {token}"}).status_code


class Clock:
    """The two clocks ``service.auth`` reads (wall clock for expiry, monotonic for its cache), moved by
    the test: an expiry 0.5 s away is then 0.5 s away however slow the machine is (with real clocks,
    a request delayed past it on a loaded machine failed the "still valid" check)."""

    def __init__(self) -> None:
        self.wall = datetime(2026, 1, 1, tzinfo=timezone.utc)
        self.elapsed = 0.0

    def utcnow(self) -> datetime:
        return self.wall + timedelta(seconds=self.elapsed)

    def monotonic(self) -> float:
        return self.elapsed

    def advance(self, seconds: float) -> None:
        self.elapsed += seconds


def test_an_expiring_token_is_refused_from_its_expiry_on(app, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(auth, "utcnow", clock.utcnow)
    monkeypatch.setattr(store, "utcnow", clock.utcnow)  # the token rows' times (created, expires, revoked)
    monkeypatch.setattr(auth, "time", SimpleNamespace(monotonic=clock.monotonic))
    with get_db(app).write() as session:
        token = create_token(session, "read", "short-lived", expires_in=0.5)
    client = app.test_client()
    assert status(client, token) == 200  # cached now, for less than the default second: until the expiry
    clock.advance(0.499)
    assert status(client, token) == 200
    clock.advance(0.001)  # at the expiry: the cache never outlives it
    assert status(client, token) == 401


def test_revocation_bites_within_the_token_cache_time_and_rotation_keeps_role_and_name(app, monkeypatch):
    clock = Clock()  # the cache's second passes at once, and exactly
    monkeypatch.setattr(auth, "utcnow", clock.utcnow)
    monkeypatch.setattr(store, "utcnow", clock.utcnow)  # the token rows' times (created, expires, revoked)
    monkeypatch.setattr(auth, "time", SimpleNamespace(monotonic=clock.monotonic))
    with get_db(app).write() as session:
        token = create_token(session, "ingest", "recommender")
        other = create_token(session, "read", "dashboard")
    client = app.test_client()
    assert status(client, token) == 200
    with get_db(app).write() as session:
        new, old = rotate_token(session, "recommender")
    assert old.revoked_at is not None
    clock.advance(TOKEN_CACHE_SECONDS)
    assert status(client, token) == 401 and status(client, new) == 200 and status(client, other) == 200
    assert client.post("/api/v1/experiments/x/assign", json={"unit": "u"},
                       headers={"Authorization": f"Bearer {new}"}).status_code == 404  # ingest role kept
    with get_db(app).write() as session:
        (revoked,) = revoke_tokens(session, "dashboard")
        assert revoked.name == "dashboard"
    with get_db(app).write() as session, pytest.raises(LookupError, match="No usable token"):
        revoke_tokens(session, "dashboard")  # already revoked
    clock.advance(TOKEN_CACHE_SECONDS)
    assert status(client, other) == 401


def test_rotating_a_name_shared_by_several_tokens_asks_for_an_id(app):
    with get_db(app).write() as session:
        create_token(session, "read", "twin")
        create_token(session, "read", "twin")
    with get_db(app).write() as session, pytest.raises(LookupError, match="rotate one by its id"):
        rotate_token(session, "twin")


@pytest.mark.parametrize("lifetime", [0, -1, float("nan"), float("inf")])
def test_a_token_lifetime_must_be_positive_and_finite(app, lifetime):
    with get_db(app).write() as session, pytest.raises(ValueError, match="positive number of seconds"):
        create_token(session, "read", "x", expires_in=lifetime)


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("90d", 7776000)])
def test_durations_of_the_cli(text, seconds):
    assert _duration(text) == seconds


@pytest.mark.parametrize("token, weak", [
    ("admin-token", True),
    ("a" * 64, True),
    ("0123456789012345678901234", True),  # digits only: 25 x log2(10) = 83 bits
    # Named: a random token as the test id would differ between pytest-xdist's workers, which must
    # collect the same tests.
    pytest.param(secrets.token_urlsafe(32), False, id="token_urlsafe(32)"),
    pytest.param(secrets.token_hex(32), False, id="token_hex(32)"),
])
def test_admin_token_strength(token, weak):
    assert (admin_token_weakness(token) is not None) == weak


def test_a_weak_admin_token_is_accepted_with_a_warning(sqlite_url, caplog):
    with caplog.at_level(logging.WARNING, logger="service.auth"):
        app = make_app(sqlite_url, PASTO_ADMIN_TOKEN="admin-token")
    try:
        assert status(app.test_client(), "admin-token") == 200
        (record,) = [r for r in caplog.records if "PASTO_ADMIN_TOKEN is weak" in r.getMessage()]
        assert "11 characters" in record.getMessage() and "token_urlsafe(32)" in record.getMessage()
    finally:
        get_db(app).engine.dispose()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="service.auth"):
        strong = make_app(sqlite_url, PASTO_ADMIN_TOKEN=secrets.token_urlsafe(32))
    get_db(strong).engine.dispose()
    assert not [r for r in caplog.records if "PASTO_ADMIN_TOKEN" in r.getMessage()]


def test_metrics_needs_a_scrape_token_unless_anonymous_scrapes_are_opted_in(app, sqlite_url):
    with get_db(app).write() as session:
        scrape = create_token(session, "metrics", "prometheus")
        read = create_token(session, "read", "dashboard")
    client = app.test_client()
    anonymous = client.get("/metrics")
    assert anonymous.status_code == 401 and anonymous.get_json()["error"]["code"] == "unauthorized"
    for token in (scrape, read):
        response = client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 200 and "pasto_database_up 1.0" in response.get_data(as_text=True)
    # A scrape token reads nothing else.
    assert status(client, scrape) == 403
    app.config["PASTO_METRICS_ANONYMOUS"] = True
    assert client.get("/metrics").status_code == 200
    assert client.get(LIST).status_code == 401  # the opt-in is for /metrics only


def test_the_anonymous_scrape_opt_in_is_read_from_the_environment(monkeypatch, tmp_path):
    from service.config import load_config

    assert load_config(str(tmp_path))["PASTO_METRICS_ANONYMOUS"] is False
    monkeypatch.setenv("PASTO_METRICS_ANONYMOUS", "1")
    assert load_config(str(tmp_path))["PASTO_METRICS_ANONYMOUS"] is True
