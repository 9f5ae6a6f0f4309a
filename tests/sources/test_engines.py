"""Each engine's round statistics equal numpy's on the same events, for both forms, and late rows restate.

Cases: DuckDB over Parquet and over CSV files, PostgreSQL tables (the private test cluster, URL given
through an environment variable), Spark local over Parquet and over CSV. Forms: the table mapping
(pasto generates the GROUP BY) and a raw SQL template of the same rule.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa

from service.sources import RoundWindow, fetch_round_statistics, parse_source


class FileCase:
    """Events as files in a folder of parts: DuckDB or Spark reads every part at each query."""

    def __init__(self, data, folder: Path, engine: str, file_format: str):
        self.data, self.folder, self.engine, self.file_format = data, folder, engine, file_format
        self.parts = 0

    def load(self, events) -> None:
        self.data.write_files(events, self.folder, self.file_format, f"part-{self.parts}")
        self.parts += 1

    def source(self, form: str) -> dict:
        suffix = self.file_format
        spec = {"files": {"exposures": {"path": str(self.folder / "exposures" / f"*.{suffix}"), "format": suffix},
                          "events": {"path": str(self.folder / "events" / f"*.{suffix}"), "format": suffix}}}
        if self.engine == "spark":
            spec.update(engine="spark", url="local[1]")
        if form == "mapping":
            spec["mapping"] = self.data.mapping_spec()
        else:
            spec["sql"] = self.data.TEMPLATE_SQL.format(exposures="exposures", events="events")
        return spec


class PostgresCase:
    """Events as PostgreSQL tables; the source's URL is read from an environment variable."""

    def __init__(self, data, url: str, monkeypatch):
        self.data, self.url = data, url
        monkeypatch.setenv("PASTO_TEST_WAREHOUSE_URL", url)
        metadata = sa.MetaData()
        self.exposures = sa.Table(
            "exposure_log", metadata, sa.Column("experiment", sa.Text), sa.Column("unit", sa.Text),
            sa.Column("round", sa.Integer), sa.Column("ts", sa.DateTime), sa.Column("arm", sa.Text))
        self.events = sa.Table(
            "metric_events", metadata, sa.Column("unit", sa.Text), sa.Column("ts", sa.DateTime),
            sa.Column("x", sa.Double), sa.Column("y", sa.Double))
        self.engine = sa.create_engine(url)
        metadata.create_all(self.engine)

    def load(self, events) -> None:
        def naive(rows, position):
            # timestamp-without-zone columns hold UTC
            return [row[:position] + (row[position].replace(tzinfo=None),) + row[position + 1:] for row in rows]

        with self.engine.begin() as connection:
            connection.execute(self.exposures.insert(), [dict(zip(self.data.EXPOSURE_COLUMNS, row))
                                                         for row in naive(events.exposure_rows(), 3)])
            connection.execute(self.events.insert(), [dict(zip(self.data.EVENT_COLUMNS, row))
                                                      for row in naive(events.event_rows(), 1)])

    def source(self, form: str) -> dict:
        spec: dict = {"url_env": "PASTO_TEST_WAREHOUSE_URL"}
        if form == "mapping":
            spec["mapping"] = self.data.mapping_spec("exposure_log", "metric_events")
        else:
            spec["sql"] = self.data.TEMPLATE_SQL.format(exposures="exposure_log", events="metric_events")
        return spec


@pytest.fixture(params=[
    "duckdb-parquet", "duckdb-csv",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("spark-parquet", marks=pytest.mark.spark),
    pytest.param("spark-csv", marks=pytest.mark.spark),
])
def case(request, eventdata, tmp_path, monkeypatch):
    if request.param == "postgres":
        pg = PostgresCase(eventdata, request.getfixturevalue("postgres_url"), monkeypatch)
        yield pg
        pg.engine.dispose()
        return
    engine, file_format = request.param.split("-")
    if engine == "spark":
        request.getfixturevalue("spark")
    yield FileCase(eventdata, tmp_path, engine, file_format)


def _window(data, round_index: int) -> RoundWindow:
    starts_at, ends_at = data.window(round_index)
    return RoundWindow(round_index, starts_at, ends_at)


def _assert_equal(result, expected) -> None:
    counts, sums, squares, units = expected
    np.testing.assert_array_equal(result.statistics.counts, counts)
    np.testing.assert_allclose(result.statistics.sums, sums, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(result.statistics.sums_of_squares, squares, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(result.units, units)


@pytest.mark.parametrize("form", ["mapping", "sql"])
def test_round_statistics_equal_numpy_and_late_rows_restate_the_round(case, form, eventdata):
    data = eventdata
    events = data.make_events(np.random.default_rng(16), rounds=2)
    case.load(events)
    source = parse_source(case.source(form))

    first = {}
    for round_index in (0, 1):
        result = fetch_round_statistics(source, data.EXPERIMENT, _window(data, round_index), data.ARMS, data.METRICS)
        expected = data.expected_statistics(events, round_index)
        assert expected[0].min() > 10, "every arm and metric has data, so a wrong cell cannot hide"
        _assert_equal(result, expected)
        first[round_index] = result

    # Late rows for round 0: more events of its exposed units (and an exposure arriving late).
    late = data.make_events(np.random.default_rng(17), rounds=1, units=300)
    case.load(late)
    everything = data.combine(events, late)
    restated = fetch_round_statistics(source, data.EXPERIMENT, _window(data, 0), data.ARMS, data.METRICS)
    _assert_equal(restated, data.expected_statistics(everything, 0))
    assert restated.statistics.counts.sum() > first[0].statistics.counts.sum()
    # Round 1 too is what numpy gets from everything (late round-0 events after its window end up
    # attributed to round-1 exposures of the same units, if any).
    again = fetch_round_statistics(source, data.EXPERIMENT, _window(data, 1), data.ARMS, data.METRICS)
    _assert_equal(again, data.expected_statistics(everything, 1))


def test_the_means_come_back(eventdata, tmp_path):
    """On many events the per-arm means of the statistics are the means the events were drawn from."""
    data = eventdata
    case = FileCase(data, tmp_path, "duckdb", "parquet")
    case.load(data.make_events(np.random.default_rng(3), rounds=1, units=3000, events_per_unit=8))
    result = fetch_round_statistics(parse_source(case.source("mapping")), data.EXPERIMENT, _window(data, 0),
                                    data.ARMS, data.METRICS)
    means = result.statistics.sums / result.statistics.counts
    np.testing.assert_allclose(means, data.MEANS, atol=0.1)


def test_window_bounds_are_half_open(eventdata, tmp_path):
    """An event at the window's end belongs to the next round; one at its start to this round."""
    data = eventdata
    start, end = data.window(0)
    folder = tmp_path
    data.write_csv(folder / "exposures" / "p.csv", data.EXPOSURE_COLUMNS,
                   [(data.EXPERIMENT, "u1", 0, start, "a"), (data.EXPERIMENT, "u1", 1, end, "b")])
    data.write_csv(folder / "events" / "p.csv", data.EVENT_COLUMNS,
                   [("u1", start, 1.0, None), ("u1", end, 5.0, None)])
    case = FileCase(data, folder, "duckdb", "csv")
    source = parse_source(case.source("mapping"))
    round_0 = fetch_round_statistics(source, data.EXPERIMENT, _window(data, 0), data.ARMS, data.METRICS)
    round_1 = fetch_round_statistics(source, data.EXPERIMENT, _window(data, 1), data.ARMS, data.METRICS)
    assert round_0.statistics.sums.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert round_0.statistics.counts[1].tolist() == [0.0, 0.0, 0.0]  # NULL y: not observed
    assert round_1.statistics.sums.tolist() == [[0.0, 5.0, 0.0], [0.0, 0.0, 0.0]]
    assert round_0.units.tolist() == [1, 0, 0] and round_1.units.tolist() == [0, 1, 0]
    assert isinstance(start, datetime)


def test_zoned_timestamp_columns_on_duckdb(eventdata, tmp_path):
    """TIMESTAMPTZ columns (instants) compare with the UTC window as TIMESTAMP columns do."""
    import duckdb

    data = eventdata
    events = data.make_events(np.random.default_rng(21), rounds=1)
    data.write_files(events, tmp_path / "plain", "csv", "p")
    connection = duckdb.connect()
    connection.execute("SET TimeZone = 'UTC'")
    for table in ("exposures", "events"):
        (tmp_path / "zoned" / table).mkdir(parents=True)
        connection.execute(
            f"COPY (SELECT * REPLACE (ts::TIMESTAMPTZ AS ts) FROM read_csv_auto('{tmp_path}/plain/{table}/p.csv')) "
            f"TO '{tmp_path}/zoned/{table}/p.parquet' (FORMAT parquet)")
    column_type = connection.execute(
        f"SELECT typeof(ts) FROM read_parquet('{tmp_path}/zoned/events/p.parquet') LIMIT 1").fetchone()[0]
    connection.close()
    assert column_type == "TIMESTAMP WITH TIME ZONE"
    case = FileCase(data, tmp_path / "zoned", "duckdb", "parquet")
    result = fetch_round_statistics(parse_source(case.source("mapping")), data.EXPERIMENT, _window(data, 0),
                                    data.ARMS, data.METRICS)
    _assert_equal(result, data.expected_statistics(events, 0))
