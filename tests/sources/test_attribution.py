"""Attribution by round, not by clock: every unit served in a round is counted in that round, however
long the source query that closes it takes.

A source experiment with 3-second rounds (``settle_seconds = 0``: each close runs the update in the
same transaction) is served steady assignment traffic by a thread, in real time, while the real
scheduler tick runs in another. Every assigned unit's exposure (with the round the service answered)
and one event at the same instant land in the warehouse at once. The source's answer reaches the
close 4 s after its query read the warehouse (longer than a round): the query's data is as old as a
slow query's, and everything served in between lands after it. When the traffic stops and two more
rounds have closed (each update re-queries the round before it), every round's distinct units and
counts equal the units exposed in it, exactly, on DuckDB, PostgreSQL and Spark.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone

import pytest

import service.controller.sources as sources_controller
import service.scheduler as scheduler_module
from service import create_app
from service.auth import create_token
from service.db import get_db
from tests.migrated import upgrade_to_head
from tests.sources.test_scheduled_rounds import ParquetLanding, PostgresLanding, mapping

ADMIN = "bootstrap-admin-token-for-attribution-tests"
NAME = "attributed"
ROUND_SECONDS = 3
#: The source answers this long after its query read the warehouse (a slow query).
ANSWER_DELAY = 4.0
TRAFFIC_SECONDS = 18.0
BATCH = 4
#: Seconds between two assignment batches (each lands its rows at once).
BATCH_INTERVAL = 0.1


class AtomicParquetLanding(ParquetLanding):
    """Each landing is one more Parquet file per table, written under a hidden name and renamed into
    the folder: a query running meanwhile reads whole files only (the readers skip hidden names)."""

    def land(self, exposures: list[tuple], events: list[tuple]) -> None:
        import pyarrow
        import pyarrow.parquet

        for table, columns, types, rows in (
                ("exposures", ("experiment", "unit", "round", "ts", "arm"),
                 (pyarrow.string(), pyarrow.string(), pyarrow.int64(), pyarrow.timestamp("us"), pyarrow.string()),
                 exposures),
                ("events", ("unit", "ts", "x", "y"),
                 (pyarrow.string(), pyarrow.timestamp("us"), pyarrow.float64(), pyarrow.float64()), events)):
            if not rows:
                continue
            schema = pyarrow.schema(list(zip(columns, types)))
            naive = [tuple(value.replace(tzinfo=None) if isinstance(value, datetime) else value for value in row)
                     for row in rows]
            data = pyarrow.Table.from_pylist([dict(zip(columns, row)) for row in naive], schema=schema)
            hidden = self.folder / table / f".part-{self.parts:05d}.tmp"
            pyarrow.parquet.write_table(data, hidden)
            os.replace(hidden, self.folder / table / f"part-{self.parts:05d}.parquet")
        self.parts += 1


def _run(tmp_path, monkeypatch, landing, source: dict, batch_interval: float = BATCH_INTERVAL,
         traffic_seconds: float = TRAFFIC_SECONDS, answer_delay: float = ANSWER_DELAY, closes: int = 2) -> None:
    database_url = f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    upgrade_to_head(database_url)
    app = create_app({"PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": ADMIN, "TESTING": True})
    with get_db(app).write() as session:
        ingest = create_token(session, "ingest", "attribution")
    client = app.test_client()
    body = {"name": NAME, "arms": [{"name": arm, "params": {}} for arm in ("a", "b", "c")], "metrics": ["x", "y"],
            "objective": {"primary": "x"}, "round_seconds": ROUND_SECONDS, "settle_seconds": 0, "seed": 5,
            "source": source}
    response = client.post("/api/v1/experiments", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 201, response.get_json()

    real_fetch = sources_controller.fetch_round_statistics

    def slow_fetch(*args, **kwargs):
        result = real_fetch(*args, **kwargs)
        time.sleep(answer_delay)
        return result

    monkeypatch.setattr(sources_controller, "fetch_round_statistics", slow_fetch)

    stop_traffic = threading.Event()
    stop_scheduler = threading.Event()
    spanned = threading.Event()  # set once a unit is served in round `closes`: the traffic spans closes
    exposed: dict[int, set[str]] = defaultdict(set)
    failures: list[BaseException] = []

    def traffic() -> None:
        number = 0
        try:
            while not stop_traffic.is_set():
                units = [f"u{number + i}" for i in range(BATCH)]
                number += BATCH
                answer = client.post(f"/api/v1/experiments/{NAME}/assign", json={"units": units},
                                     headers={"Authorization": f"Bearer {ingest}"})
                assert answer.status_code == 200, answer.get_json()
                served_at = datetime.now(timezone.utc)
                exposures, events = [], []
                for assignment in answer.get_json()["assignments"]:
                    exposed[assignment["round"]].add(assignment["unit"])
                    if assignment["round"] >= closes:
                        spanned.set()
                    exposures.append((NAME, assignment["unit"], assignment["round"], served_at, assignment["arm"]))
                    events.append((assignment["unit"], served_at, 1.0, 0.5))
                landing.land(exposures, events)
                time.sleep(batch_interval)
        except BaseException as error:  # reported by the test thread
            failures.append(error)

    def scheduler() -> None:
        try:
            while not stop_scheduler.is_set():
                scheduler_module.run_scheduled_work(app, "attribution-test")
                time.sleep(0.25)
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=traffic, daemon=True), threading.Thread(target=scheduler, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(traffic_seconds)
        # The traffic goes on until it spans `closes` closes, which traffic_seconds allows on a quiet
        # machine; a loaded one can take longer over a close (a Spark query). Hang guard, not a tolerance.
        deadline = time.monotonic() + 300
        while not failures and time.monotonic() < deadline:
            if spanned.wait(timeout=0.5):
                break
        stop_traffic.set()
        threads[0].join(timeout=60)
        last_served = max(exposed)
        # Hang guard, not a tolerance: two more closes (each re-queries the round before it) take
        # about 2 x (round + answer delay) on a quiet machine. The guard is on progress, 120 s
        # without a close applied: two Spark closes over the test's ~80 small files per table took
        # more than 120 s together on a saturated machine, and a fixed guard for both ran out.
        applied = -1
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not failures:
            experiment = client.get(f"/api/v1/experiments/{NAME}", headers={"Authorization": f"Bearer {ADMIN}"})
            now_applied = experiment.get_json()["applied_rounds"]
            if now_applied >= last_served + 2:
                break
            if now_applied > applied:
                applied, deadline = now_applied, time.monotonic() + 120
            time.sleep(0.5)
    finally:
        stop_traffic.set()
        stop_scheduler.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not failures, failures
    history = client.get(f"/api/v1/experiments/{NAME}/rounds?limit=1000",
                         headers={"Authorization": f"Bearer {ADMIN}"}).get_json()
    assert history["source_error"] is None
    rounds = {entry["index"]: entry for entry in history["rounds"]}
    assert rounds[last_served + 1]["applied_at"] is not None
    assert last_served >= closes  # the traffic spanned closes
    # Units served while a slow close was under way: counted in the round they were served in.
    for index in range(last_served + 1):
        assert sum(rounds[index]["units"]) == len(exposed[index]), (index, rounds[index]["units"],
                                                                      len(exposed[index]))
        assert sum(rounds[index]["counts"]) == len(exposed[index]), index
    assert sum(sum(rounds[index]["units"]) for index in rounds) == sum(len(units) for units in exposed.values())
    print(f"{source.get('engine', 'sqlalchemy')} {source.get('url', source.get('url_env'))}: rounds 0..{last_served}, "
          f"units exposed {[len(exposed[index]) for index in range(last_served + 1)]}, counted "
          f"{[sum(rounds[index]['units']) for index in range(last_served + 1)]}")
    get_db(app).engine.dispose()


def test_duckdb_counts_every_unit_served(tmp_path, monkeypatch):
    landing = AtomicParquetLanding(tmp_path / "warehouse")
    _run(tmp_path, monkeypatch, landing, {"url": "duckdb:///:memory:", "files": landing.files(), "mapping": mapping()})


@pytest.mark.postgres
def test_postgresql_counts_every_unit_served(tmp_path, postgres_url, monkeypatch):
    monkeypatch.setenv("PASTO_TEST_WAREHOUSE_URL", postgres_url)
    landing = PostgresLanding(postgres_url)
    try:
        _run(tmp_path, monkeypatch, landing,
             {"url_env": "PASTO_TEST_WAREHOUSE_URL", "mapping": mapping("exposure_log", "metric_events")})
    finally:
        landing.engine.dispose()


@pytest.mark.spark
def test_spark_counts_every_unit_served(spark, tmp_path, monkeypatch):
    # Fewer, larger landings: Spark local reads each file of the glob in every query. A Spark query
    # takes seconds of its own (a close runs two: the round and the one before), so the answer is
    # delayed less. 20 s of traffic span two closes on a quiet machine (rounds 0..2); _run waits
    # for the traffic to span one however long a close takes. Every further second of traffic is
    # a Spark query over more files for each close (40 s spanned five closes in 61 s against 37 s,
    # the JVM busy all along).
    landing = AtomicParquetLanding(tmp_path / "warehouse")
    _run(tmp_path, monkeypatch, landing,
         {"engine": "spark", "url": "local[1]", "files": landing.files(), "mapping": mapping()},
         batch_interval=0.5, traffic_seconds=20.0, answer_delay=1.0, closes=1)
