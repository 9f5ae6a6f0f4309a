"""A broken source raises SourceError with a sentence saying what is wrong; declarations are checked."""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from service.sources import RoundWindow, SourceError, fetch_round_statistics, parse_source


@pytest.fixture
def files(eventdata, tmp_path):
    eventdata.write_files(eventdata.make_events(np.random.default_rng(5), rounds=1), tmp_path, "parquet", "p")
    return {"exposures": {"path": str(tmp_path / "exposures" / "*.parquet")},
            "events": {"path": str(tmp_path / "events" / "*.parquet")}}


def _fetch(eventdata, spec: dict):
    starts_at, ends_at = eventdata.window(0)
    return fetch_round_statistics(parse_source(spec), eventdata.EXPERIMENT, RoundWindow(0, starts_at, ends_at),
                                  eventdata.ARMS, eventdata.METRICS)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_bad_sql_names_the_engine_and_its_message(eventdata, files):
    with pytest.raises(SourceError, match=r"^The metric source's SQL does not parse: .*SELEC"):
        parse_source({"files": files, "sql": "SELEC arm FROM events"})
    # A declaration stored before the check: refused again at run time, before the engine runs it.
    stored = dataclasses.replace(parse_source({"files": files, "sql": "SELECT 1"}), sql="SELEC arm FROM events")
    starts_at, ends_at = eventdata.window(0)
    with pytest.raises(SourceError, match=r"^The metric source at duckdb:///:memory: refused the query: .*SELEC"):
        fetch_round_statistics(stored, eventdata.EXPERIMENT, RoundWindow(0, starts_at, ends_at), eventdata.ARMS,
                               eventdata.METRICS)


def test_missing_table(eventdata, files):
    spec = {"files": files, "mapping": eventdata.mapping_spec("exposures", "no_such_events")}
    with pytest.raises(SourceError, match="refused the query: .*no_such_events"):
        _fetch(eventdata, spec)


def test_wrong_column_in_the_mapping(eventdata, files):
    mapping = eventdata.mapping_spec()
    mapping["events"]["metrics"] = {"x": "x", "y": "revenue"}
    with pytest.raises(SourceError, match="refused the query: .*revenue"):
        _fetch(eventdata, {"files": files, "mapping": mapping})


def test_sql_without_the_required_columns(eventdata, files):
    sql = "SELECT arm, 'x' AS metric, count(*) AS n FROM exposures GROUP BY arm"
    with pytest.raises(SourceError, match=r"without \['count', 'sum', 'sum_of_squares'\]; it must return arm"):
        _fetch(eventdata, {"files": files, "sql": sql})


def test_unknown_arm_and_metric(eventdata, files):
    sql = "SELECT 'zzz' AS arm, 'x' AS metric, 1 AS count, 1.0 AS sum, 1.0 AS sum_of_squares"
    # The returned value is a row's: the message names the experiment's arms, never the value.
    with pytest.raises(SourceError, match=r"returned an arm which is not one of the experiment's arms") as error:
        _fetch(eventdata, {"files": files, "sql": sql})
    assert "zzz" not in str(error.value)
    sql = "SELECT 'a' AS arm, 'clicks' AS metric, 1 AS count, 1.0 AS sum, 1.0 AS sum_of_squares"
    with pytest.raises(SourceError, match=r"returned a metric which is not one of the experiment's") as error:
        _fetch(eventdata, {"files": files, "sql": sql})
    assert "clicks" not in str(error.value)


def test_impossible_statistics_are_refused(eventdata, files):
    # Two values summing to 10 have a sum of squares of at least 50.
    sql = "SELECT 'a' AS arm, 'x' AS metric, 2 AS count, 10.0 AS sum, 1.0 AS sum_of_squares"
    with pytest.raises(SourceError, match="no real values have them"):
        _fetch(eventdata, {"files": files, "sql": sql})
    sql = "SELECT 'a' AS arm, 'x' AS metric, 1 AS count, 'NaN'::DOUBLE AS sum, 1.0 AS sum_of_squares"
    with pytest.raises(SourceError, match="which is not finite"):
        _fetch(eventdata, {"files": files, "sql": sql})


def test_a_template_may_use_some_parameters_and_omit_cells(eventdata, files):
    sql = ("SELECT 'b' AS arm, 'y' AS metric, 2 AS count, 3.0 AS sum, 5.0 AS sum_of_squares, 2 AS units "
           "WHERE :round_index = 0")
    result = _fetch(eventdata, {"files": files, "sql": sql})
    assert result.statistics.counts.tolist() == [[0, 0, 0], [0, 2, 0]]
    assert result.statistics.sums_of_squares.tolist() == [[0, 0, 0], [0, 5.0, 0]]
    assert result.units.tolist() == [0, 2, 0]


def test_unreachable_postgres(eventdata):
    url = f"postgresql+psycopg://nobody@127.0.0.1:{_free_port()}/warehouse"
    with pytest.raises(SourceError, match=r"^The metric source at postgresql\+psycopg://nobody@127.0.0.1:\d+/"
                                          r"warehouse could not be reached: "):
        _fetch(eventdata, {"url": url, "sql": "SELECT 1"})


def test_missing_driver(eventdata):
    with pytest.raises(SourceError, match="is the engine's SQLAlchemy dialect installed"):
        _fetch(eventdata, {"url": "snowflake://me@account/db", "sql": "SELECT 1"})


def test_secrets_come_from_the_environment_and_are_never_shown(eventdata, monkeypatch):
    source = parse_source({"url": "postgresql+psycopg://reader@db.internal/warehouse",
                           "password_env": "PASTO_TEST_WAREHOUSE_PASSWORD", "sql": "SELECT 1"})
    with pytest.raises(SourceError, match="PASTO_TEST_WAREHOUSE_PASSWORD .* is not set"):
        source.resolved_url()
    monkeypatch.setenv("PASTO_TEST_WAREHOUSE_PASSWORD", "s3cr:et@")
    assert source.resolved_url() == "postgresql+psycopg://reader:s3cr%3Aet%40@db.internal/warehouse"
    assert "s3cr" not in source.describe_url()
    whole = parse_source({"url_env": "PASTO_TEST_WAREHOUSE_URL", "sql": "SELECT 1"})
    assert whole.describe_url() == "$PASTO_TEST_WAREHOUSE_URL"
    with pytest.raises(SourceError, match="PASTO_TEST_WAREHOUSE_URL .* is not set"):
        _fetch(eventdata, {"url_env": "PASTO_TEST_WAREHOUSE_URL", "sql": "SELECT 1"})


@pytest.mark.parametrize("spec, message", [
    ({"url": "postgresql+psycopg://u:hunter2@h/db", "sql": "SELECT 1"}, "contains a password"),
    ({"sql": "SELECT 1", "mapping": {}}, "exactly one of"),
    ({}, "exactly one of"),
    ({"engine": "oracle-on-a-floppy", "sql": "SELECT 1"}, "engine is 'oracle-on-a-floppy'"),
    ({"url": "x", "url_env": "Y", "sql": "SELECT 1"}, "both"),
    ({"url": "not a url", "sql": "SELECT 1"}, "is not an SQLAlchemy URL"),
    ({"engine": "spark", "url": "http://cluster", "sql": "SELECT 1"}, "Spark Connect URL"),
    ({"engine": "spark", "password_env": "P", "sql": "SELECT 1"}, "takes no \"password_env\""),
    ({"sql": "SELECT 1", "tables": {}}, "unknown keys \\['tables'\\]"),
    ({"files": {"events": {"path": "/x", "format": "orc"}}, "sql": "SELECT 1"}, "format is 'orc'"),
    ({"url": "postgresql+psycopg://h/db", "files": {"e": {"path": "/x"}}, "sql": "SELECT 1"},
     "read by DuckDB and Spark only"),
    ({"mapping": {"exposures": {"table": "e", "unit": "u", "arm": "a"},
                  "events": {"table": "v", "unit": "u", "timestamp": "t", "metrics": {"x": "x"}}}},
     "needs a \"round\" column, a \"timestamp\" column or both"),
    ({"mapping": {"exposures": {"table": "e; DROP TABLE x", "unit": "u", "arm": "a", "round": "r"},
                  "events": {"table": "v", "unit": "u", "timestamp": "t", "metrics": {"x": "x"}}}},
     "must be a plain SQL name"),
    ({"mapping": {"exposures": {"table": "e", "unit": "u", "arm": "a", "round": "r"},
                  "events": {"table": "v", "unit": "u", "timestamp": "t", "metrics": {}}}},
     "at least one metric"),
])
def test_declarations_pasto_cannot_use(spec, message):
    with pytest.raises(SourceError, match=message):
        parse_source(spec)


def test_a_mapping_without_a_metric_of_the_experiment(eventdata, files):
    mapping = eventdata.mapping_spec()
    mapping["events"]["metrics"] = {"x": "x"}
    with pytest.raises(SourceError, match=r"has no column for the experiment's metrics \['y'\]"):
        _fetch(eventdata, {"files": files, "mapping": mapping})


@pytest.mark.spark
def test_spark_bad_sql_and_missing_files(eventdata, files, spark):
    spec = {"engine": "spark", "url": "local[1]", "files": files, "sql": "SELEC arm FROM events"}
    with pytest.raises(SourceError, match=r"^The metric source's SQL does not parse"):
        parse_source(spec)
    stored = dataclasses.replace(parse_source({**spec, "sql": "SELECT 1"}), sql=spec["sql"])
    starts_at, ends_at = eventdata.window(0)
    with pytest.raises(SourceError, match=r"^The Spark metric source at local\[1\] failed: "):
        fetch_round_statistics(stored, eventdata.EXPERIMENT, RoundWindow(0, starts_at, ends_at), eventdata.ARMS,
                               eventdata.METRICS)
    missing = {"events": {"path": "/nonexistent/pasto/*.parquet"}}
    with pytest.raises(SourceError, match=r"^The Spark metric source at local\[1\] failed: .*nonexistent"):
        _fetch(eventdata, {"engine": "spark", "files": missing, "sql": "SELECT 1"})
