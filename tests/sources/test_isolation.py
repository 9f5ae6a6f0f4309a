"""One hung metric source stalls nothing else: the real scheduler (``start_scheduler``) runs a
PostgreSQL source whose query sleeps 60 s under a 10 s statement timeout beside an experiment with
2-second rounds. The other experiment closes every round within one scheduler interval of its end,
the heartbeat stays fresh, and ``/healthz`` says throughout what is true: the scheduler is alive, and
once the hung source has failed, which experiment's source fails (without the engine's text)."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from service import create_app
from service.auth import create_token
from service.db import get_db
from service.scheduler import start_scheduler
from tests.migrated import upgrade_to_head

ADMIN = "bootstrap-admin-token-for-isolation-tests"
INTERVAL = 1.0
STATEMENT_TIMEOUT = 10.0
RUN_SECONDS = 26.0
#: How late after one scheduler interval a tick may start on a loaded machine (APScheduler's wake-up).
WAKE_UP = 0.25


def _body(name: str, source: dict | None) -> dict:
    body = {"name": name, "arms": [{"name": arm, "params": {}} for arm in ("a", "b")], "metrics": ["x"],
            "objective": {"primary": "x"}, "round_seconds": 2, "settle_seconds": 0, "seed": 3}
    if source is not None:
        body["source"] = source
    return body


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.mark.postgres
def test_a_hung_source_delays_no_other_experiment(tmp_path, postgres_url, monkeypatch):
    monkeypatch.setenv("PASTO_TEST_WAREHOUSE_URL", postgres_url)
    database_url = f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    upgrade_to_head(database_url)
    app = create_app({"PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": ADMIN, "TESTING": True,
                      "PASTO_SCHEDULER_INTERVAL": INTERVAL, "PASTO_SOURCE_STATEMENT_TIMEOUT": STATEMENT_TIMEOUT})
    with get_db(app).write() as session:
        reader = create_token(session, "read", "isolation")
    client = app.test_client()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    hung = {"url_env": "PASTO_TEST_WAREHOUSE_URL",
            "sql": "SELECT 'a' AS arm, 'x' AS metric, 1 AS count, 1.0 AS sum, 1.0 AS sum_of_squares "
                   "WHERE pg_sleep(60) IS NOT NULL"}
    for name, source in (("hung", hung), ("steady", None)):
        response = client.post("/api/v1/experiments", json=_body(name, source), headers=admin)
        assert response.status_code == 201, response.get_json()

    scheduler = start_scheduler(app)
    reports = []
    try:
        # The scheduler is alive from its first heartbeat (its first tick, which a loaded machine can
        # delay past the first poll); every report from then on must say so.
        started = time.monotonic() + 30
        while not client.get("/healthz").get_json()["scheduler"]["alive"] and time.monotonic() < started:
            time.sleep(0.05)
        ends = time.monotonic() + RUN_SECONDS
        while time.monotonic() < ends:
            reports.append(client.get("/healthz").get_json())
            time.sleep(0.5)
    finally:
        scheduler.shutdown(wait=False)

    # The other experiment: every round closed within one interval of its end (the tick's own time).
    rounds = client.get("/api/v1/experiments/steady/rounds?limit=1000", headers=admin).get_json()["rounds"]
    closed = [entry for entry in rounds if entry["closed_at"] is not None]
    lags = [(_time(entry["closed_at"]) - _time(entry["ends_at"])).total_seconds() for entry in closed]
    assert max(lags) <= INTERVAL + WAKE_UP, lags
    # A round lasts 2 s plus its close's wait for the next tick (at most one interval).
    assert len(closed) >= RUN_SECONDS // (2 + INTERVAL) - 1, lags
    print(f"steady: {len(closed)} rounds closed, lag after ends_at max {max(lags):.3f} s "
          f"(scheduler interval {INTERVAL:g} s)")
    assert all(entry["applied_at"] is not None for entry in closed)

    # The hung source: cut off at the statement timeout (round 0 still open), and said so.
    hung_history = client.get("/api/v1/experiments/hung/rounds", headers=admin).get_json()
    assert hung_history["rounds"][0]["closed_at"] is None
    error = hung_history["source_error"]
    assert "statement timeout of 10 s" in error["message"] and error["failures"] >= 1

    # /healthz, anonymous, all along: the scheduler alive; never "ok" while a source is failing; the
    # failing source named with its start, never its message.
    first_failure = next(index for index, report in enumerate(reports) if report["sources"])
    for index, report in enumerate(reports):
        assert report["scheduler"]["alive"] is True, (index, report)
        if index < first_failure:
            assert report["status"] == "ok" and report["sources"] == [], (index, report)
        else:
            assert report["status"] == "degraded", (index, report)
            assert report["sources"] == [{"experiment": "hung", "since": error["since"]}], (index, report)
    assert first_failure < len(reports) - 5  # degraded for several reports before the end
    # With a read token, the message.
    report = client.get("/healthz", headers={"Authorization": f"Bearer {reader}"}).get_json()
    assert report["sources"] == [{"experiment": "hung", "since": error["since"], "message": error["message"]}]
