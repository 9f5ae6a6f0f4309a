"""Events from known means, written where each engine reads them, and the statistics numpy gets from them.

:func:`make_events` draws exposures and events with a fixed seed so that every part of the attribution
rule (service/sources/query.py) matters: units exposed twice (the first exposure's arm counts), events
before the exposure, events outside the round's window, units never exposed, another experiment's rows,
and NULL metric values. :func:`expected_statistics` applies the rule in plain numpy, independently of
the SQL, and the tests compare each engine's result with it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

EXPERIMENT = "ranking"
ARMS = ("a", "b", "c")
METRICS = ("x", "y")
#: Per metric (rows) and arm (columns): the means events are drawn from.
MEANS = np.array([[1.0, 2.0, 3.0], [-1.0, 0.5, 4.0]])
START = datetime(2026, 3, 1, tzinfo=timezone.utc)
ROUND = timedelta(hours=1)


@dataclass
class Events:
    """Exposure and event rows as column arrays (timestamps: whole seconds after START)."""

    exposure_experiment: np.ndarray
    exposure_unit: np.ndarray
    exposure_round: np.ndarray
    exposure_second: np.ndarray
    exposure_arm: np.ndarray
    event_unit: np.ndarray
    event_second: np.ndarray
    event_x: np.ndarray  # nan = not observed
    event_y: np.ndarray

    def exposure_rows(self) -> list[tuple]:
        return [(str(e), str(u), int(r), START + timedelta(seconds=int(s)), str(a))
                for e, u, r, s, a in zip(self.exposure_experiment, self.exposure_unit, self.exposure_round,
                                         self.exposure_second, self.exposure_arm)]

    def event_rows(self) -> list[tuple]:
        def value(v):
            return None if np.isnan(v) else float(v)
        return [(str(u), START + timedelta(seconds=int(s)), value(x), value(y))
                for u, s, x, y in zip(self.event_unit, self.event_second, self.event_x, self.event_y)]


def window(round_index: int) -> tuple[datetime, datetime]:
    return START + round_index * ROUND, START + (round_index + 1) * ROUND


def make_events(rng: np.random.Generator, rounds: int = 2, units: int = 300,
                events_per_unit: float = 4.0, round_offset: int = 0) -> Events:
    """Exposures and events of ``rounds`` rounds (starting at ``round_offset``) from :data:`MEANS`."""
    seconds = int(ROUND.total_seconds())
    exp_cols: dict[str, list] = {k: [] for k in ("experiment", "unit", "round", "second", "arm")}
    ev_cols: dict[str, list] = {k: [] for k in ("unit", "second", "x", "y")}
    for r in range(round_offset, round_offset + rounds):
        exposed = rng.random(units) < 0.7
        arm_of = rng.integers(0, len(ARMS), units)
        for u in np.flatnonzero(exposed):
            first = r * seconds + int(rng.integers(0, seconds - 600))
            exposures = [(first, arm_of[u])]
            if rng.random() < 0.2:  # a repeat exposure, sometimes (wrongly) to another arm: the first counts
                other = arm_of[u] if rng.random() < 0.5 else (arm_of[u] + 1) % len(ARMS)
                exposures.append((first + int(rng.integers(0, 300)), other))
            for second, arm in exposures:
                exp_cols["experiment"].append(EXPERIMENT)
                exp_cols["unit"].append(f"u{u:05d}")
                exp_cols["round"].append(r)
                exp_cols["second"].append(second)
                exp_cols["arm"].append(ARMS[arm])
            n = rng.poisson(events_per_unit)
            # Some events before the exposure or after the window: not the round's.
            times = rng.integers(first - 900, (r + 1) * seconds + 300, n)
            if rng.random() < 0.1:
                times = np.append(times, first)  # at the exposure instant: counts
            for second in times:
                ev_cols["unit"].append(f"u{u:05d}")
                ev_cols["second"].append(int(second))
                x = rng.normal(MEANS[0, arm_of[u]], 1.0)
                y = rng.normal(MEANS[1, arm_of[u]], 2.0) if rng.random() < 0.7 else np.nan
                ev_cols["x"].append(x)
                ev_cols["y"].append(y)
        # Another experiment's exposures of the same units, and events of units never exposed.
        for u in rng.choice(units, 20, replace=False):
            exp_cols["experiment"].append("other-experiment")
            exp_cols["unit"].append(f"u{units + u:05d}")
            exp_cols["round"].append(r)
            exp_cols["second"].append(r * seconds + 5)
            exp_cols["arm"].append(ARMS[0])
            ev_cols["unit"].append(f"u{units + u:05d}")
            ev_cols["second"].append(r * seconds + 60)
            ev_cols["x"].append(100.0)
            ev_cols["y"].append(100.0)
    return Events(
        np.array(exp_cols["experiment"]), np.array(exp_cols["unit"]), np.array(exp_cols["round"]),
        np.array(exp_cols["second"]), np.array(exp_cols["arm"]),
        np.array(ev_cols["unit"]), np.array(ev_cols["second"]), np.array(ev_cols["x"]), np.array(ev_cols["y"]),
    )


def combine(first: Events, second: Events) -> Events:
    return Events(*(np.concatenate([getattr(first, f), getattr(second, f)])
                    for f in Events.__dataclass_fields__))


def expected_statistics(events: Events, round_index: int):
    """(counts, sums, sums_of_squares) of shape (M, K) and units of shape (K,), by the rule, in numpy."""
    seconds = int(ROUND.total_seconds())
    lo, hi = round_index * seconds, (round_index + 1) * seconds
    first_exposure: dict[str, tuple[int, str]] = {}
    for e, u, r, s, a in zip(events.exposure_experiment, events.exposure_unit, events.exposure_round,
                             events.exposure_second, events.exposure_arm):
        if e != EXPERIMENT or r != round_index:
            continue
        if u not in first_exposure or (s, a) < first_exposure[u]:
            first_exposure[u] = (int(s), str(a))
    counts, sums, squares = (np.zeros((len(METRICS), len(ARMS))) for _ in range(3))
    units: list[set] = [set() for _ in ARMS]
    for u, s, x, y in zip(events.event_unit, events.event_second, events.event_x, events.event_y):
        if u not in first_exposure or not lo <= s < hi:
            continue
        exposed_at, arm = first_exposure[u]
        if s < exposed_at:
            continue
        k = ARMS.index(arm)
        units[k].add(u)
        for m, value in enumerate((x, y)):
            if not np.isnan(value):
                counts[m, k] += 1
                sums[m, k] += value
                squares[m, k] += value * value
    return counts, sums, squares, np.array([len(s) for s in units])


# ------------------------------------------------------------------------------------------ file writers


def _csv_field(value) -> str:
    if isinstance(value, float):
        return repr(value)  # shortest repr: reads back to the same double
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return "" if value is None else str(value)


def write_csv(path: Path, header: tuple[str, ...], rows: list[tuple]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        out.write(",".join(header) + "\n")
        for row in rows:
            out.write(",".join(_csv_field(v) for v in row) + "\n")


EXPOSURE_COLUMNS = ("experiment", "unit", "round", "ts", "arm")
EVENT_COLUMNS = ("unit", "ts", "x", "y")
_EXPOSURE_TYPES = "{'experiment': 'VARCHAR', 'unit': 'VARCHAR', 'round': 'BIGINT', 'ts': 'TIMESTAMP', 'arm': 'VARCHAR'}"
_EVENT_TYPES = "{'unit': 'VARCHAR', 'ts': 'TIMESTAMP', 'x': 'DOUBLE', 'y': 'DOUBLE'}"


def write_files(events: Events, folder: Path, file_format: str, part: str) -> None:
    """Append the events as one more file in ``folder/exposures/`` and ``folder/events/``."""
    import duckdb

    for table, header, rows, types in (
        ("exposures", EXPOSURE_COLUMNS, events.exposure_rows(), _EXPOSURE_TYPES),
        ("events", EVENT_COLUMNS, events.event_rows(), _EVENT_TYPES),
    ):
        csv_path = folder / table / f"{part}.csv"
        write_csv(csv_path, header, rows)
        if file_format == "parquet":
            connection = duckdb.connect()
            connection.execute(
                f"COPY (SELECT * FROM read_csv('{csv_path}', header = true, columns = {types})) "
                f"TO '{folder / table / (part + '.parquet')}' (FORMAT parquet)")
            connection.close()
            csv_path.unlink()


def mapping_spec(exposures_table: str = "exposures", events_table: str = "events") -> dict:
    return {
        "exposures": {"table": exposures_table, "unit": "unit", "arm": "arm", "experiment": "experiment",
                      "round": "round", "timestamp": "ts"},
        "events": {"table": events_table, "unit": "unit", "timestamp": "ts", "metrics": {"x": "x", "y": "y"}},
    }


#: The same rule as a team's own SQL (long form: one row per arm and metric), in SQL that DuckDB,
#: PostgreSQL and Spark all run.
TEMPLATE_SQL = """
WITH ranked AS (
    SELECT unit, arm, ts, row_number() OVER (PARTITION BY unit ORDER BY ts, arm) AS exposure_rank
    FROM {exposures} WHERE experiment = :experiment AND round = :round_index
), joined AS (
    SELECT r.arm, r.unit, e.x, e.y
    FROM ranked r JOIN {events} e
      ON e.unit = r.unit AND r.exposure_rank = 1
     AND e.ts >= :starts_at AND e.ts < :ends_at AND e.ts >= r.ts
), arm_units AS (
    SELECT arm, count(DISTINCT unit) AS units FROM joined GROUP BY arm
)
SELECT j.arm, 'x' AS metric, count(j.x) AS count, sum(j.x) AS sum, sum(j.x * j.x) AS sum_of_squares,
       max(u.units) AS units
FROM joined j JOIN arm_units u ON u.arm = j.arm GROUP BY j.arm
UNION ALL
SELECT j.arm, 'y' AS metric, count(j.y), sum(j.y), sum(j.y * j.y), max(u.units)
FROM joined j JOIN arm_units u ON u.arm = j.arm GROUP BY j.arm
"""


# ------------------------------------------------------------------------------------------------ Spark


def _java_available() -> bool:
    return shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for the suite: local[1], one shuffle partition, UI off, UTC.

    The JVM runs the client compiler only (``TieredStopAtLevel=1``) and the serial collector: the
    session lives for a few minutes of small queries, where C2's optimising compilations and G1's
    parallel and concurrent threads cost more CPU than they give back (a quarter of the JVM's CPU on the
    spark-marked tests). Neither changes what a query returns."""
    pyspark = pytest.importorskip("pyspark", reason="PySpark is not installed (pip install '.[warehouse]').")
    if not _java_available():
        pytest.skip("Java is not installed (Debian package openjdk-17-jre-headless); Spark needs it.")
    from pyspark.sql import SparkSession

    del pyspark
    session = (SparkSession.builder.master("local[1]").appName("pasto-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "1")
               .config("spark.default.parallelism", "1")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.memory", "512m")
               .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def eventdata():
    """This module: its generators, writers and constants for the test files (tests is not a package)."""
    import sys

    return sys.modules[__name__]
