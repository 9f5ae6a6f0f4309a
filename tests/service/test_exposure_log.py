"""The assign endpoint's exposure log (PASTO_EXPOSURE_LOG): one record per assigned unit, exactly the
answer the client got, in the client's schema, written by a thread of each process."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from pasto_client.exposure import COLUMN_NAMES
from service.auth import create_token
from service.config import ConfigurationError
from service.db import get_db
from service.exposures import get_exposures

from .conftest import Api

N_UNITS = 10_000


def arms(n: int = 5) -> list[dict]:
    return [{"name": f"blend-{k}", "params": {"w": k}} for k in range(n)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_every_assigned_unit_is_logged_as_answered(app_factory, sqlite_url, tmp_path, setup_a, suffix):
    path = tmp_path / f"exposures{suffix}"
    app = app_factory(sqlite_url, PASTO_EXPOSURE_LOG=str(path))
    with get_db(app).write() as session:
        tokens = {role: create_token(session, role, f"test-{role}") for role in ("ingest", "admin")}
    api = Api(app.test_client(), tokens)
    assert api("POST", "/api/v1/experiments", json=setup_a("feed", arms=arms())).status_code == 201
    assign = "/api/v1/experiments/feed/assign"
    units = [f"user-{i}" for i in range(N_UNITS)] + [f"ユーザー-{i}" for i in range(500)]
    answers = []
    for start in range(0, N_UNITS, 2500):
        response = api("POST", assign, role="ingest", json={"units": units[start:start + 2500]})
        answers += response.get_json()["assignments"]
    answers += [api("POST", assign, role="ingest", json={"unit": unit}).get_json() for unit in units[N_UNITS:]]
    experiment = api("GET", "/api/v1/experiments/feed").get_json()

    recorder = get_exposures(app)
    log = recorder.log
    log.close()  # writes everything queued and closes the file (a Parquet file is readable after)
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as file:
            records = [json.loads(line) for line in file]
    else:
        records = pq.read_table(tmp_path / f"exposures.{os.getpid()}.parquet").to_pylist()
    assert len(records) == len(units)
    assert all(tuple(record) == COLUMN_NAMES for record in records)
    assert [(r["unit"], r["arm"], r["round"], r["probability"]) for r in records] == [
        (a["unit"], a["arm"], a["round"], a["probability"]) for a in answers
    ]
    names = [arm["name"] for arm in experiment["arms"]]
    assert all(r["arm_index"] == names.index(r["arm"]) for r in records)
    assert {r["experiment"] for r in records} == {"feed"}
    assert {r["mixture_version"] for r in records} == {experiment["updated_at"]}
    assert (log.written, log.dropped, log.failed) == (len(units), 0, 0)


def test_without_the_setting_nothing_is_logged(app, api, setup_a, tmp_path):
    assert get_exposures(app) is None
    api("POST", "/api/v1/experiments", json=setup_a())
    assert api("POST", "/api/v1/experiments/setup-a/assign", role="ingest", json={"unit": "u"}).status_code == 200


def test_a_file_that_cannot_be_opened_never_breaks_assignment(app_factory, sqlite_url, tmp_path, setup_a, caplog):
    path = tmp_path / "exposures.jsonl"
    path.mkdir()  # a directory where the file should be: opening it fails at the first request
    app = app_factory(sqlite_url, PASTO_EXPOSURE_LOG=str(path))
    with get_db(app).write() as session:
        tokens = {role: create_token(session, role, f"test-{role}") for role in ("ingest", "admin")}
    api = Api(app.test_client(), tokens)
    api("POST", "/api/v1/experiments", json=setup_a())
    for body in ({"unit": "u"}, {"units": ["v", "w"]}):
        assert api("POST", "/api/v1/experiments/setup-a/assign", role="ingest", json=body).status_code == 200
    assert caplog.text.count("Cannot open the exposure log") == 1  # retried every 10 s, not per request
    assert get_exposures(app).log is None


@pytest.mark.parametrize("value, message", [
    ("exposures.csv", "must end in .jsonl or .parquet"),
    ("/no/such/directory/exposures.jsonl", "directory"),
])
def test_an_unusable_setting_is_refused_at_startup(app_factory, sqlite_url, value, message):
    with pytest.raises(ConfigurationError, match=message):
        app_factory(sqlite_url, PASTO_EXPOSURE_LOG=value)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_pasto_serve_writes_the_queue_when_it_stops(tmp_path, setup_a, admin_token, suffix):
    """A real `pasto serve`: what it assigned is in the file after SIGTERM (a Parquet file complete)."""
    import signal
    import subprocess
    import sys
    import time

    import requests

    import migrations
    from bench.pgcluster import free_port

    database_url = f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    migrations.upgrade(database_url)
    path = tmp_path / f"exposures{suffix}"
    port = free_port()
    env = {**os.environ, "PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": admin_token,
           "PASTO_EXPOSURE_LOG": str(path)}
    log = open(tmp_path / "server.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "pasto.cli", "serve", "--host", "127.0.0.1", "--port",
                                str(port), "--no-scheduler"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api/v1/experiments"
    headers = {"Authorization": f"Bearer {admin_token}"}
    try:
        # Hang guard, not a tolerance: the server answers within seconds.
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()
            try:
                requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except requests.RequestException:
                assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.1)
        assert requests.post(url, json=setup_a("feed", arms=arms()), headers=headers, timeout=30).status_code == 201
        units = [f"user-{i}" for i in range(3000)]
        answers = requests.post(f"{url}/feed/assign", json={"units": units}, headers=headers,
                                timeout=30).json()["assignments"]
        with requests.Session() as session:
            answers += [session.post(f"{url}/feed/assign", json={"unit": f"single-{i}"}, headers=headers,
                                     timeout=30).json() for i in range(200)]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
        log.close()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as file:
            records = [json.loads(line) for line in file]
    else:
        (written,) = tmp_path.glob("exposures.*.parquet")  # one file per process: <stem>.<pid>.parquet
        records = pq.read_table(written).to_pylist()
    assert [(r["unit"], r["arm"], r["probability"]) for r in records] == [
        (a["unit"], a["arm"], a["probability"]) for a in answers
    ]
