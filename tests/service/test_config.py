"""Settings read from the environment (``service.config``): they reach the running app, and an unusable
value is refused with a sentence naming the setting."""

from __future__ import annotations

import json
import re

import pytest

from service.config import DEFAULT_DASHBOARD_POLL_SECONDS, DEFAULT_MAX_CONTENT_LENGTH, ConfigurationError, load_config
from service.db import get_db

from .conftest import ADMIN_TOKEN, make_app

ASSIGN = "/api/v1/experiments/setup-a/assign"


@pytest.fixture
def clean_environment(monkeypatch):
    for key in ("PASTO_MAX_CONTENT_LENGTH", "PASTO_DASHBOARD_POLL_SECONDS"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def test_defaults(clean_environment, tmp_path):
    config = load_config(str(tmp_path))
    assert config["MAX_CONTENT_LENGTH"] == DEFAULT_MAX_CONTENT_LENGTH == 16 * 1024 * 1024
    assert config["PASTO_DASHBOARD_POLL_SECONDS"] == DEFAULT_DASHBOARD_POLL_SECONDS == 5.0


def test_max_content_length_from_the_environment_limits_requests(clean_environment, sqlite_url, setup_a):
    clean_environment.setenv("PASTO_MAX_CONTENT_LENGTH", "2048")
    app = make_app(sqlite_url)
    try:
        assert app.config["MAX_CONTENT_LENGTH"] == 2048
        client = app.test_client()
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert client.post("/api/v1/experiments", json=setup_a(), headers=headers).status_code == 201
        small = client.post(ASSIGN, json={"units": [f"unit-{i}" for i in range(10)]}, headers=headers)
        assert small.status_code == 200
        large = client.post(ASSIGN, json={"units": [f"unit-{i}" for i in range(500)]}, headers=headers)
        assert large.status_code == 413
        error = large.get_json()["error"]
        assert error["details"] == {"max_content_length": 2048}
        assert "2,048 bytes" in error["message"] and "PASTO_MAX_CONTENT_LENGTH" in error["message"]
    finally:
        get_db(app).engine.dispose()


def test_dashboard_poll_seconds_from_the_environment_reach_the_page(clean_environment, sqlite_url):
    clean_environment.setenv("PASTO_DASHBOARD_POLL_SECONDS", "0.75")
    app = make_app(sqlite_url)
    try:
        page = app.test_client().get("/").get_data(as_text=True)
        page_config = json.loads(re.search(r'<script id="page-config" type="application/json">(.*?)</script>',
                                           page).group(1))
        assert page_config["pollSeconds"] == 0.75
    finally:
        get_db(app).engine.dispose()


@pytest.mark.parametrize("key, text, message", [
    ("PASTO_MAX_CONTENT_LENGTH", "16MB", "PASTO_MAX_CONTENT_LENGTH must be a positive whole number of bytes"),
    ("PASTO_MAX_CONTENT_LENGTH", "0", "PASTO_MAX_CONTENT_LENGTH must be a positive whole number of bytes"),
    ("PASTO_MAX_CONTENT_LENGTH", "-5", "PASTO_MAX_CONTENT_LENGTH must be a positive whole number of bytes"),
    ("PASTO_MAX_CONTENT_LENGTH", "1.5e6", "PASTO_MAX_CONTENT_LENGTH must be a positive whole number of bytes"),
    ("PASTO_DASHBOARD_POLL_SECONDS", "often", "PASTO_DASHBOARD_POLL_SECONDS must be a positive number of seconds"),
    ("PASTO_DASHBOARD_POLL_SECONDS", "0", "PASTO_DASHBOARD_POLL_SECONDS must be a positive number of seconds"),
    ("PASTO_DASHBOARD_POLL_SECONDS", "nan", "PASTO_DASHBOARD_POLL_SECONDS must be a positive number of seconds"),
    ("PASTO_DASHBOARD_POLL_SECONDS", "inf", "PASTO_DASHBOARD_POLL_SECONDS must be a positive number of seconds"),
])
def test_an_unusable_value_is_refused_naming_the_setting(clean_environment, tmp_path, key, text, message):
    clean_environment.setenv(key, text)
    with pytest.raises(ConfigurationError) as info:
        load_config(str(tmp_path))
    assert str(info.value).startswith(message) and str(info.value).endswith(f", got {text!r}.")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "many"])
def test_max_content_length_in_the_mapping_is_checked_too(clean_environment, tmp_path, value):
    with pytest.raises(ConfigurationError, match="PASTO_MAX_CONTENT_LENGTH must be a positive whole number"):
        load_config(str(tmp_path), {"MAX_CONTENT_LENGTH": value})


def test_database_deadlines_from_the_environment_reach_the_engine(monkeypatch, tmp_path):
    monkeypatch.setenv("PASTO_DATABASE_STATEMENT_TIMEOUT", "4.5")
    monkeypatch.setenv("PASTO_SQLITE_BUSY_TIMEOUT", "0.25")
    monkeypatch.setenv("PASTO_DATABASE_RETRY_AFTER", "7")
    config = load_config(str(tmp_path))
    assert config["PASTO_DATABASE_STATEMENT_TIMEOUT"] == 4.5
    assert config["PASTO_DATABASE_CONNECT_TIMEOUT"] == 3.0 and config["PASTO_DATABASE_POOL_TIMEOUT"] == 5.0
    assert config["PASTO_DATABASE_RETRY_AFTER"] == 7
    app = make_app(f"sqlite:///{tmp_path / 'pasto.sqlite'}")
    try:
        engine = get_db(app).engine
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 250
        assert engine.pool.timeout() == 5.0
    finally:
        get_db(app).engine.dispose()


@pytest.mark.parametrize("key, value", [("PASTO_DATABASE_STATEMENT_TIMEOUT", "0"),
                                        ("PASTO_HEALTHZ_TIMEOUT", "soon"),
                                        ("PASTO_DATABASE_RETRY_AFTER", "2.5")])
def test_unusable_database_deadlines_are_refused(monkeypatch, tmp_path, key, value):
    monkeypatch.setenv(key, value)
    with pytest.raises(ConfigurationError, match=key):
        load_config(str(tmp_path))


@pytest.mark.parametrize("text, seconds", [(None, 7 * 86_400), ("3600", 3600.0), ("0", 0.0), ("forever", None),
                                           (" Forever ", None)])
def test_retention_seconds(monkeypatch, tmp_path, text, seconds):
    monkeypatch.delenv("PASTO_RETENTION_SECONDS", raising=False)
    if text is not None:
        monkeypatch.setenv("PASTO_RETENTION_SECONDS", text)
    assert load_config(str(tmp_path))["PASTO_RETENTION_SECONDS"] == seconds


@pytest.mark.parametrize("text", ["-1", "a week", "nan", "inf"])
def test_unusable_retention_is_refused(monkeypatch, tmp_path, text):
    monkeypatch.setenv("PASTO_RETENTION_SECONDS", text)
    with pytest.raises(ConfigurationError) as info:
        load_config(str(tmp_path))
    assert str(info.value) == ("PASTO_RETENTION_SECONDS must be zero or a positive number of seconds, or 'forever', "
                               f"got {text!r}.")


def test_the_scheduler_prunes_with_the_configured_retention(sqlite_url, setup_a, caplog):
    """run_retention (the scheduler's job) prunes a round applied longer ago than PASTO_RETENTION_SECONDS,
    and says so in the log; start_scheduler runs it every PASTO_RETENTION_CHECK_SECONDS. (What pruning
    does to a resend: tests/service/usecases/test_retention.py.)"""
    import logging

    import sqlalchemy as sa

    from service.models import Experiment
    from service.scheduler import run_retention, start_scheduler

    app = make_app(sqlite_url, PASTO_RETENTION_SECONDS=0, PASTO_RETENTION_CHECK_SECONDS=0.5)
    scheduler = start_scheduler(app)
    try:
        job = scheduler.get_job("pasto-retention")
        assert job is not None and job.func is run_retention and job.args == (app,)
        assert job.trigger.interval.total_seconds() == 0.5
    finally:
        scheduler.shutdown(wait=True)
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    client = app.test_client()
    assert client.post("/api/v1/experiments", json=setup_a(), headers=headers).status_code == 201
    observation = {"id": "o1", "unit": "u1", "round": 0, "values": {"x": 1.0}}
    assert client.post("/api/v1/experiments/setup-a/observations", json={"observations": [observation]},
                       headers=headers).status_code == 202
    assert client.post("/api/v1/experiments/setup-a/rounds", headers=headers).status_code == 200
    with caplog.at_level(logging.INFO, logger="service.scheduler"):
        result = run_retention(app)
    assert list(result.advanced.values()) == [1] and result.deleted["observation_ids"] == 1
    assert "Retention: pruned rounds below" in caplog.text
    with get_db(app).read() as session:
        assert session.execute(sa.select(Experiment.pruned_rounds)).scalar_one() == 1
    refused = client.post("/api/v1/experiments/setup-a/observations", json={"observations": [observation]},
                          headers=headers)
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "round_pruned"
    get_db(app).engine.dispose()
