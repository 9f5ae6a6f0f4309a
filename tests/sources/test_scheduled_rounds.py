"""Warehouse-sourced experiments run end to end by the real scheduler tick, against the webhook.

Each test runs two experiments with the same arms, metrics and seed in one service: one declares a
metric source (DuckDB over Parquet files, PostgreSQL tables, or Spark local over Parquet files), the
other gets the very same events through the observation webhook. The scheduler's own tick
(``service.scheduler.run_scheduled_work``, on an injected clock) closes and updates both, for 30
rounds. Units are assigned by the service (the twin must assign them the same arms: it learns the
same mixture), events are drawn from known means and land in three waves per round:

- on time (before the round closes),
- after the close but before the update (``settle_seconds``; DuckDB and PostgreSQL): the source's
  second query of the round restates it, and nothing may be counted twice,
- for two rounds, after the round's update: late, found when the next update re-queries the round
  (``late_rounds`` = 1), as the webhook counts late observations at once.

The round history (counts, units, late observations, means), the diagnostics and the learned mixture
must be equal to 1e-9. A broken source keeps the experiment serving and shows its error in the round
history, diagnostics, ``/healthz``, ``/metrics`` and the dashboard page; once fixed, the round closes
at the next tick with nothing lost.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from tests.migrated import upgrade_to_head
import service.controller.experiments as experiments_controller
import service.controller.reports as reports_controller
import service.scheduler as scheduler_module
from service import create_app
from service.auth import create_token
from service.bootstrap import get_uow
from service.db import get_db
from tests.round_counts import assert_round_counts_match

START = datetime(2026, 3, 1, tzinfo=timezone.utc)
ROUND_SECONDS = 3600
SETTLE_SECONDS = 600
ROUNDS = 30
UNITS_PER_ROUND = 40
LATE_ROUNDS = (5, 17)
SPARK_ROUNDS = 20
ADMIN = "bootstrap-admin-token-for-source-tests"
ARMS = ("a", "b", "c")
#: Per arm: the means of metrics x and y.
MEANS = {"a": (1.0, -1.0), "b": (2.0, 0.5), "c": (2.5, 4.0)}
EXPOSURE_TYPES = "experiment VARCHAR, unit VARCHAR, round BIGINT, ts TIMESTAMP, arm VARCHAR"
EVENT_TYPES = "unit VARCHAR, ts TIMESTAMP, x DOUBLE, y DOUBLE"


def mapping(exposures: str = "exposures", events: str = "events") -> dict:
    return {
        "exposures": {"table": exposures, "unit": "unit", "arm": "arm", "experiment": "experiment",
                      "round": "round", "timestamp": "ts"},
        "events": {"table": events, "unit": "unit", "timestamp": "ts", "metrics": {"x": "x", "y": "y"}},
    }


def experiment_body(name: str, source: dict | None, settle_seconds: int = SETTLE_SECONDS) -> dict:
    body = {
        "name": name,
        "arms": [{"name": arm, "params": {}} for arm in ARMS],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "round_seconds": ROUND_SECONDS,
        "settle_seconds": settle_seconds,
        "seed": 11,
    }
    if source is not None:
        body["source"] = source
    return body


# ------------------------------------------------------------------------------------------- landings


class ParquetLanding:
    """Rows land as new Parquet files in ``folder/exposures`` and ``folder/events`` (read by a glob)."""

    def __init__(self, folder: Path, compact: bool = False):
        # compact: each landing rewrites one file per table with every row so far (and removes the
        # previous one), as a compacting job would; Spark local then reads 2 files per query, not 90.
        self.folder = folder
        self.compact = compact
        self.rows: dict[str, list[tuple]] = {"exposures": [], "events": []}
        self.parts = 0
        (folder / "exposures").mkdir(parents=True)
        (folder / "events").mkdir(parents=True)

    def files(self) -> dict:
        return {"exposures": {"path": str(self.folder / "exposures" / "*.parquet"), "format": "parquet"},
                "events": {"path": str(self.folder / "events" / "*.parquet"), "format": "parquet"}}

    def land(self, exposures: list[tuple], events: list[tuple]) -> None:
        import duckdb
        import pyarrow

        previous = sorted(self.folder.glob("*/part-*.parquet")) if self.compact else []
        if self.compact:
            self.rows["exposures"] += exposures
            self.rows["events"] += events
            exposures, events = self.rows["exposures"], self.rows["events"]
        connection = duckdb.connect()
        try:
            for table, types, rows in (("exposures", EXPOSURE_TYPES, exposures), ("events", EVENT_TYPES, events)):
                if not rows:
                    continue
                connection.execute(f"CREATE OR REPLACE TABLE landing ({types})")
                # One bulk insert from an Arrow table, cast to the declared types: DuckDB's executemany
                # runs one statement per row, and a compacting landing rewrites every row so far at each
                # wave (about 150,000 rows over 30 rounds: most of the Spark test's time).
                columns = [column.split()[0] for column in types.split(", ")]
                arrow_rows = pyarrow.Table.from_pylist([dict(zip(columns, _naive(row))) for row in rows])
                connection.register("arrow_rows", arrow_rows)
                quoted = ", ".join(f'"{column}"' for column in columns)
                connection.execute(f"INSERT INTO landing SELECT {quoted} FROM arrow_rows")
                connection.unregister("arrow_rows")
                connection.execute(f"COPY landing TO '{self.folder / table / f'part-{self.parts:04d}.parquet'}' "
                                   "(FORMAT parquet)")
        finally:
            connection.close()
        for path in previous:
            path.unlink()
        self.parts += 1


class PostgresLanding:
    """Rows land in the tables ``exposure_log`` and ``metric_events`` of a PostgreSQL database."""

    def __init__(self, url: str):
        metadata = sa.MetaData()
        self.exposures = sa.Table(
            "exposure_log", metadata, sa.Column("experiment", sa.Text), sa.Column("unit", sa.Text),
            sa.Column("round", sa.Integer), sa.Column("ts", sa.DateTime), sa.Column("arm", sa.Text))
        self.events = sa.Table(
            "metric_events", metadata, sa.Column("unit", sa.Text), sa.Column("ts", sa.DateTime),
            sa.Column("x", sa.Double), sa.Column("y", sa.Double))
        self.engine = sa.create_engine(url)
        metadata.create_all(self.engine)

    def land(self, exposures: list[tuple], events: list[tuple]) -> None:
        with self.engine.begin() as connection:
            if exposures:
                connection.execute(self.exposures.insert(), [
                    dict(zip(("experiment", "unit", "round", "ts", "arm"), _naive(row))) for row in exposures])
            if events:
                connection.execute(self.events.insert(), [
                    dict(zip(("unit", "ts", "x", "y"), _naive(row))) for row in events])


def _naive(row: tuple) -> tuple:
    """Timestamps without a zone hold UTC in the warehouse tables."""
    return tuple(value.replace(tzinfo=None) if isinstance(value, datetime) else value for value in row)


# ---------------------------------------------------------------------------------------------- the run


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


class Run:
    """The service, its two experiments (``sourced``, ``webhook``) and the scheduler tick on a clock."""

    SOURCED, WEBHOOK = "sourced", "webhook"

    def __init__(self, database_url: str, monkeypatch, settle_seconds: int = SETTLE_SECONDS):
        self.settle_seconds = settle_seconds
        self.clock = Clock()
        monkeypatch.setattr(scheduler_module, "utcnow", self.clock)
        monkeypatch.setattr(experiments_controller, "utcnow", self.clock)
        monkeypatch.setattr(reports_controller, "utcnow", self.clock)  # /healthz: the scheduler is alive
        upgrade_to_head(database_url)
        self.app = create_app({"PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": ADMIN, "TESTING": True,
                               "PASTO_VERSION_CHECK_SECONDS": 0})
        with get_db(self.app).write() as session:
            self.ingest_token = create_token(session, "ingest", "source-tests")
        self.client = self.app.test_client()
        self.observation_ids = 0

    def call(self, method: str, path: str, token: str | None = None, **kwargs):
        return self.client.open(path, method=method, headers={"Authorization": f"Bearer {token or ADMIN}"}, **kwargs)

    def create(self, source: dict) -> None:
        for name, declared in ((self.SOURCED, source), (self.WEBHOOK, None)):
            response = self.call("POST", "/api/v1/experiments",
                                 json=experiment_body(name, declared, self.settle_seconds))
            assert response.status_code == 201, response.get_json()

    def tick(self, at: datetime) -> None:
        self.clock.now = at
        scheduler_module.run_scheduled_work(self.app, "test-scheduler")

    def assign(self, units: list[str]) -> list[str]:
        arms = {}
        for name in (self.SOURCED, self.WEBHOOK):
            response = self.call("POST", f"/api/v1/experiments/{name}/assign", self.ingest_token, json={"units": units})
            assert response.status_code == 200, response.get_json()
            arms[name] = [answer["arm"] for answer in response.get_json()["assignments"]]
        assert arms[self.SOURCED] == arms[self.WEBHOOK]  # the same mixture learned so far
        return arms[self.SOURCED]

    def post_observations(self, round_index: int, events: list[tuple]) -> None:
        observations = []
        for unit, _, x, y in events:
            self.observation_ids += 1
            values = {"x": x} if y is None else {"x": x, "y": y}
            observations.append({"id": f"obs-{self.observation_ids}", "unit": unit, "round": round_index,
                                 "values": values})
        if observations:
            response = self.call("POST", f"/api/v1/experiments/{self.WEBHOOK}/observations", self.ingest_token,
                                 json={"observations": observations})
            assert response.status_code == 202, response.get_json()
            assert response.get_json()["accepted"] == len(observations)

    def history(self, name: str) -> dict:
        response = self.call("GET", f"/api/v1/experiments/{name}/rounds?limit=1000")
        assert response.status_code == 200, response.get_json()
        return response.get_json()

    def get(self, path: str) -> dict:
        response = self.call("GET", path)
        assert response.status_code == 200, response.get_json()
        return response.get_json()


def round_start(round_index: int) -> datetime:
    return START + timedelta(seconds=round_index * ROUND_SECONDS)


def draw_round(rng: np.random.Generator, round_index: int, units: list[str], arms: list[str]):
    """Exposures of the round's units and their events in three waves (on time, before the update, late)."""
    exposures, waves = [], {"on_time": [], "before_update": [], "late": []}
    begin = round_start(round_index)
    for unit, arm in zip(units, arms):
        exposed = int(rng.integers(0, ROUND_SECONDS - 900))
        exposures.append((Run.SOURCED, unit, round_index, begin + timedelta(seconds=exposed), arm))
        for second in np.sort(rng.integers(exposed, ROUND_SECONDS, 1 + rng.poisson(2))).tolist():
            x = float(rng.normal(MEANS[arm][0], 1.0))
            y = float(rng.normal(MEANS[arm][1], 2.0)) if rng.random() < 0.7 else None
            wave = rng.choice(["on_time", "before_update", "late"], p=[0.75, 0.2, 0.05])
            if wave == "late" and round_index not in LATE_ROUNDS:
                wave = "before_update"
            waves[str(wave)].append((unit, begin + timedelta(seconds=second), x, y))
    return exposures, waves


def run_rounds(run: Run, landing, rng: np.random.Generator, rounds: int = ROUNDS) -> None:
    """``rounds`` rounds: assign, land and post each wave, and tick at each close and each update."""
    for r in range(rounds):
        run.clock.now = round_start(r) + timedelta(seconds=1)
        units = [f"r{r}-u{i}" for i in range(UNITS_PER_ROUND)]
        arms = run.assign(units)
        exposures, waves = draw_round(rng, r, units, arms)
        if run.settle_seconds == 0:  # one tick closes and updates: no wave between them
            waves["on_time"] += waves.pop("before_update")
        landing.land(exposures, waves["on_time"])
        run.post_observations(r, waves["on_time"])
        run.tick(round_start(r + 1))  # closes round r; the source gives its first statement of r
        if run.settle_seconds:
            landing.land([], waves["before_update"])
            run.post_observations(r, waves["before_update"])
            run.tick(round_start(r + 1) + timedelta(seconds=run.settle_seconds))  # r's update: r restated
        if waves["late"]:
            landing.land([], waves["late"])
            run.post_observations(r, waves["late"])  # late at once; the source's at r + 1's update


def assert_same_as_webhook(run: Run, rounds: int = ROUNDS) -> None:
    sourced, webhook = run.history(Run.SOURCED), run.history(Run.WEBHOOK)
    assert sourced["source_error"] is None
    assert len(sourced["rounds"]) == len(webhook["rounds"]) == rounds + 1
    for mine, theirs in zip(sourced["rounds"], webhook["rounds"]):
        index = mine["index"]
        assert mine["applied_at"] is not None or index >= rounds, index
        assert mine["counts"] == theirs["counts"], index
        assert mine["units"] == theirs["units"], index
        assert mine["late_observations"] == theirs["late_observations"], index
        for metric in ("x", "y"):
            np.testing.assert_allclose(np.array(mine["means"][metric], dtype=float),
                                       np.array(theirs["means"][metric], dtype=float), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(mine["probabilities"], theirs["probabilities"], rtol=1e-9, atol=1e-12)
        if mine["deployed"] is not None:
            np.testing.assert_allclose(mine["deployed"], theirs["deployed"], rtol=1e-9, atol=1e-12)
    # Late rows were found and counted late, once; the rows landing before the update were not late.
    late = {entry["index"]: entry["late_observations"] for entry in sourced["rounds"] if entry["late_observations"]}
    assert set(late) <= set(LATE_ROUNDS) and late, late
    total = sum(sum(entry["counts"]) for entry in sourced["rounds"])
    assert total > rounds * UNITS_PER_ROUND
    mine, theirs = (run.get(f"/api/v1/experiments/{name}/diagnostics") for name in (Run.SOURCED, Run.WEBHOOK))
    assert mine["units"] == theirs["units"] and mine["late_observations"] == theirs["late_observations"]
    for metric in ("x", "y"):
        np.testing.assert_allclose(mine["estimate"]["means"][metric], theirs["estimate"]["means"][metric],
                                   rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(mine["estimate"]["standard_errors"][metric],
                                   theirs["estimate"]["standard_errors"][metric], rtol=1e-9, atol=1e-12)
    mine, theirs = (run.get(f"/api/v1/experiments/{name}") for name in (Run.SOURCED, Run.WEBHOOK))
    assert mine["round"]["index"] == theirs["round"]["index"] == rounds
    assert mine["applied_rounds"] == theirs["applied_rounds"] == rounds
    np.testing.assert_allclose(mine["deployed"], theirs["deployed"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(mine["probabilities"], theirs["probabilities"], rtol=1e-9, atol=1e-12)
    # The learned mixture moved towards the better arm (means: c best on x, y >= 0 holds for b and c).
    assert mine["deployed"][ARMS.index("a")] < 1 / 3
    # Restated source rounds (differences) keep round_counts equal to the per-arm counts summed.
    totals = assert_round_counts_match(get_db(run.app).engine)
    assert len({experiment_id for experiment_id, _ in totals}) == 2, totals  # the sourced and the webhook's


def test_duckdb_parquet_source_matches_the_webhook(tmp_path, monkeypatch):
    run = Run(f"sqlite:///{tmp_path / 'pasto.sqlite'}", monkeypatch)
    landing = ParquetLanding(tmp_path / "warehouse")
    run.create({"url": "duckdb:///:memory:", "files": landing.files(), "mapping": mapping()})
    assert run.get(f"/api/v1/experiments/{Run.SOURCED}")["source"]["mapping"] == mapping()
    run_rounds(run, landing, np.random.default_rng(1))
    assert_same_as_webhook(run)


@pytest.mark.postgres
def test_postgres_source_matches_the_webhook(postgres_url, monkeypatch):
    # pasto's own database holds the warehouse tables too ("the same database"); the source reads them
    # through a URL held in an environment variable.
    monkeypatch.setenv("PASTO_TEST_WAREHOUSE_URL", postgres_url)
    run = Run(postgres_url, monkeypatch)
    landing = PostgresLanding(postgres_url)
    run.create({"url_env": "PASTO_TEST_WAREHOUSE_URL", "mapping": mapping("exposure_log", "metric_events")})
    try:
        run_rounds(run, landing, np.random.default_rng(2))
        assert_same_as_webhook(run)
    finally:
        landing.engine.dispose()
        get_db(run.app).engine.dispose()


@pytest.mark.spark
def test_spark_source_matches_the_webhook(spark, tmp_path, monkeypatch):
    # settle_seconds = 0: one tick closes and updates a round (2 Spark queries per round: the round
    # and the late window's one, not 3); restating a round before its update is engine-independent
    # and tested on DuckDB and PostgreSQL.
    run = Run(f"sqlite:///{tmp_path / 'pasto.sqlite'}", monkeypatch, settle_seconds=0)
    landing = ParquetLanding(tmp_path / "warehouse", compact=True)
    run.create({"engine": "spark", "url": "local[1]", "files": landing.files(), "mapping": mapping()})
    # 20 rounds, not 30: both late rounds (5 and 17) are inside, at two Spark queries (~1 s) a round.
    run_rounds(run, landing, np.random.default_rng(3), rounds=SPARK_ROUNDS)
    assert_same_as_webhook(run, rounds=SPARK_ROUNDS)


def _metric_value(text: str, name: str, experiment: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("experiment") == experiment:
                return sample.value
    return None


def test_a_broken_source_keeps_serving_shows_its_error_and_recovers(tmp_path, monkeypatch):
    run = Run(f"sqlite:///{tmp_path / 'pasto.sqlite'}", monkeypatch)
    landing = ParquetLanding(tmp_path / "warehouse")  # empty: no file matches the source's globs yet
    run.create({"url": "duckdb:///:memory:", "files": landing.files(), "mapping": mapping()})
    run.clock.now = round_start(0) + timedelta(seconds=1)
    units = [f"r0-u{i}" for i in range(UNITS_PER_ROUND)]
    arms = run.assign(units)
    exposures, waves = draw_round(np.random.default_rng(4), 0, units, arms)
    events = waves["on_time"] + waves["before_update"]
    run.post_observations(0, events)
    served = run.get(f"/api/v1/experiments/{Run.SOURCED}")["probabilities"]

    for attempt in (1, 2):
        run.tick(round_start(1) + timedelta(seconds=SETTLE_SECONDS + attempt))
        experiment = run.get(f"/api/v1/experiments/{Run.SOURCED}")
        assert experiment["round"]["index"] == 0 and experiment["applied_rounds"] == 0  # the round stays open
        assert experiment["probabilities"] == served
        assert run.get(f"/api/v1/experiments/{Run.WEBHOOK}")["applied_rounds"] == 1  # the twin closed
        error = run.history(Run.SOURCED)["source_error"]
        assert error is not None and error["failures"] == attempt
        assert error["message"].startswith("The metric source at duckdb:///:memory: refused the query:")
        assert "parquet" in error["message"].lower()
        if attempt == 1:
            since = error["since"]
        assert error["since"] == since  # since the first failure of this run
        assert run.get(f"/api/v1/experiments/{Run.SOURCED}/diagnostics")["source_error"] == error
        health = run.client.get("/healthz")
        assert health.status_code == 200
        assert health.get_json()["status"] == "degraded"
        # Anonymous: which experiment fails and since when, never the engine's text.
        assert health.get_json()["sources"] == [{"experiment": Run.SOURCED, "since": error["since"]}]
        assert "parquet" not in health.get_data(as_text=True).lower()
        # A token that may read the experiment gets the message.
        health = run.call("GET", "/healthz", run.ingest_token)
        assert health.get_json()["sources"] == [
            {"experiment": Run.SOURCED, "since": error["since"], "message": error["message"]}]
        metrics = run.call("GET", "/metrics").get_data(as_text=True)
        assert _metric_value(metrics, "pasto_source_errors_total", Run.SOURCED) == attempt
        assert _metric_value(metrics, "pasto_source_failing", Run.SOURCED) == 1
    # Still serving: assignment answers from the mixture of round 0.
    response = run.call("POST", f"/api/v1/experiments/{Run.SOURCED}/assign", run.ingest_token, json={"unit": "late-unit"})
    assert response.status_code == 200 and response.get_json()["round"] == 0
    # The admin's close says why it cannot close the round.
    response = run.call("POST", f"/api/v1/experiments/{Run.SOURCED}/rounds", json={})
    assert response.status_code == 502
    assert response.get_json()["error"]["code"] == "source_failed"
    assert "cannot close" in response.get_json()["error"]["message"]
    assert run.history(Run.SOURCED)["source_error"]["failures"] == 3

    # Fixed: the files land; the next tick closes the round with everything in it.
    landing.land(exposures, events)
    run.tick(round_start(1) + timedelta(seconds=SETTLE_SECONDS + 10))
    experiment = run.get(f"/api/v1/experiments/{Run.SOURCED}")
    assert experiment["round"]["index"] == 1 and experiment["applied_rounds"] == 1
    sourced, webhook = run.history(Run.SOURCED), run.history(Run.WEBHOOK)
    assert sourced["source_error"] is None
    assert sourced["rounds"][0]["counts"] == webhook["rounds"][0]["counts"]
    assert sum(sourced["rounds"][0]["counts"]) == len(events)
    assert sourced["rounds"][0]["units"] == webhook["rounds"][0]["units"]
    for metric in ("x", "y"):
        np.testing.assert_allclose(np.array(sourced["rounds"][0]["means"][metric], dtype=float),
                                   np.array(webhook["rounds"][0]["means"][metric], dtype=float), rtol=1e-9)
    np.testing.assert_allclose(sourced["rounds"][0]["deployed"], webhook["rounds"][0]["deployed"], rtol=1e-9)
    health = run.client.get("/healthz").get_json()
    assert health["status"] == "ok" and health["sources"] == []
    metrics = run.call("GET", "/metrics").get_data(as_text=True)
    assert _metric_value(metrics, "pasto_source_errors_total", Run.SOURCED) == 3  # a counter: kept
    assert _metric_value(metrics, "pasto_source_failing", Run.SOURCED) == 0


@pytest.mark.parametrize("source, message", [
    ({"url": "postgresql+psycopg://reader:secret@db/warehouse", "mapping": mapping()}, "contains a password"),
    ({"url": "duckdb:///:memory:", "mapping": mapping(), "cache": True}, "unknown keys ['cache']"),
    ({"mapping": mapping(), "sql": "SELECT 1"}, "exactly one of"),
    ({"mapping": {**mapping(), "events": {**mapping()["events"], "metrics": {"x": "x"}}}}, "does not map"),
    ({"mapping": {**mapping(), "events": {**mapping()["events"], "metrics": {"x": "x", "y": "y", "z": "z"}}}},
     "['z'], which are not metrics"),
    ({"sql": "SELECT 1", "late_rounds": -1}, "late_rounds"),
    ("duckdb:///:memory:", "valid dictionary"),
    ({"url": "duckdb://host:abc/x", "mapping": mapping()}, "is not an SQLAlchemy URL"),
    ({"url": "postgresql://reader@[::1/db", "mapping": mapping()}, "is not an SQLAlchemy URL"),
])
def test_a_source_is_checked_at_creation(tmp_path, monkeypatch, source, message):
    run = Run(f"sqlite:///{tmp_path / 'pasto.sqlite'}", monkeypatch)
    response = run.call("POST", "/api/v1/experiments", json=experiment_body("checked", source))
    assert response.status_code == 422, response.get_json()
    details = response.get_json()["error"]["details"]
    assert details[0]["location"] == "source"
    assert message in details[0]["message"]
    assert run.call("GET", "/api/v1/experiments/checked").status_code == 404


def test_an_older_answer_is_never_applied_over_a_newer_one(tmp_path, monkeypatch):
    """Two schedulers query the source; the one whose queries began first answers last: its result is
    dropped (the round's update does not run with it), and the next tick updates the round with every row."""
    import service.controller.rounds as rounds_controller
    from service.controller.sources import fetch_due_rounds

    run = Run(f"sqlite:///{tmp_path / 'pasto.sqlite'}", monkeypatch)
    landing = ParquetLanding(tmp_path / "warehouse")
    run.create({"url": "duckdb:///:memory:", "files": landing.files(), "mapping": mapping()})
    run.clock.now = round_start(0) + timedelta(seconds=1)
    units = [f"r0-u{i}" for i in range(UNITS_PER_ROUND)]
    exposures, waves = draw_round(np.random.default_rng(5), 0, units, run.assign(units))
    half = len(waves["on_time"]) // 2
    first, second = waves["on_time"][:half], waves["on_time"][half:]
    landing.land(exposures, first)
    run.post_observations(0, first + second)
    database = get_db(run.app)
    with database.read() as session:
        experiment_id = session.execute(sa.text("SELECT id FROM experiments WHERE name = :name"),
                                        {"name": Run.SOURCED}).scalar_one()
    close_time = round_start(1)
    older = fetch_due_rounds(get_uow(run.app), experiment_id, close_time, manual=False)  # the first half only
    landing.land([], second)
    newer = fetch_due_rounds(get_uow(run.app), experiment_id, close_time, manual=False)  # every row
    answers = iter([newer, older])
    real_fetch = rounds_controller.fetch_due_rounds

    def delayed_fetch(database, fetched_id, *args, **kwargs):
        if fetched_id != experiment_id:  # the webhook twin
            return real_fetch(database, fetched_id, *args, **kwargs)
        return next(answers)

    monkeypatch.setattr(rounds_controller, "fetch_due_rounds", delayed_fetch)

    run.tick(close_time)  # the newer answer: round 0 closes, its first statement has every row
    closed = run.history(Run.SOURCED)["rounds"][0]
    assert closed["closed_at"] is not None and closed["applied_at"] is None
    assert sum(closed["counts"]) == len(first) + len(second)
    update_time = close_time + timedelta(seconds=SETTLE_SECONDS)
    run.tick(update_time)  # the older answer arrives when the update is due: dropped, nothing runs
    after = run.history(Run.SOURCED)["rounds"][0]
    assert after["applied_at"] is None and after["counts"] == closed["counts"]
    assert next(answers, None) is None  # both answers were used
    monkeypatch.setattr(rounds_controller, "fetch_due_rounds", real_fetch)
    run.tick(update_time + timedelta(seconds=1))  # the next tick queries again and updates
    updated = run.history(Run.SOURCED)["rounds"][0]
    webhook = run.history(Run.WEBHOOK)["rounds"][0]
    assert updated["applied_at"] is not None and updated["late_observations"] == 0
    assert updated["counts"] == closed["counts"] == webhook["counts"] and updated["units"] == webhook["units"]
    np.testing.assert_allclose(updated["deployed"], webhook["deployed"], rtol=1e-9)


def test_a_source_that_cannot_be_stored_is_a_422(tmp_path, monkeypatch):
    run = Run(f"sqlite:///{tmp_path / 'pasto.sqlite'}", monkeypatch)
    response = run.call("POST", "/api/v1/experiments", json=experiment_body(
        "checked", {"sql": "SELECT 1 -- \x00", "url": "duckdb:///:memory:"}))
    assert response.status_code == 422
    assert response.get_json()["error"]["details"][0]["location"].startswith("source")
