"""A source's SQL is one read-only SELECT over its declared tables: refused at creation otherwise, and
each engine runs it sandboxed (the second fence, tested here with the parser check taken away)."""

from __future__ import annotations

import dataclasses
import os
from datetime import datetime, timezone

import numpy as np
import pytest
import sqlalchemy as sa

import service.sources.run as source_run
from service.sources import RoundWindow, SourceError, fetch_round_statistics, parse_source
from service.sources.sandbox import display_message
from service.sources.spec import SourceLimits

#: The issue's first attack: the service's environment read as a file, echoed by a conversion error.
READ_ENVIRON = ("SELECT 'a0' AS arm, 'x' AS metric, CAST(substr(content, strpos(content, 'PASTO_ADMIN_TOKEN'), 80) "
                "AS INTEGER) AS count, 0.0 AS sum, 0.0 AS sum_of_squares FROM read_text('/proc/self/environ')")
#: The second: a file written, then a harmless SELECT.
COPY_THEN_SELECT = ("COPY (SELECT 'x') TO 'out.csv'; SELECT 'a0' AS arm, 'x' AS metric, 1 AS count, 0.0 AS sum, "
                    "0.0 AS sum_of_squares")
ARMS, METRICS = ("a0", "a1"), ("x",)
WINDOW = RoundWindow(0, datetime(2026, 3, 1, tzinfo=timezone.utc), datetime(2026, 3, 1, 1, tzinfo=timezone.utc))


@pytest.mark.parametrize("sql, message", [
    (READ_ENVIRON, "calls ['read_text']"),
    (COPY_THEN_SELECT, "exactly one SELECT; it has 2 statements (COPY, SELECT)"),
    ("COPY (SELECT 1) TO 'out.csv'", "statement of type COPY"),
    ("INSERT INTO events VALUES (1)", "statement of type INSERT"),
    ("DELETE FROM events", "statement of type DELETE"),
    ("ATTACH 'other.duckdb'", "statement of type ATTACH"),
    ("SET enable_external_access = true", "statement of type SET"),
    ("PRAGMA version", "statement of type PRAGMA"),
    ("SELECT 1; SELECT 2", "2 statements"),
    ("SELECT * FROM '/etc/passwd'", "reads the path '/etc/passwd' as a table"),
    ("SELECT * FROM 'out.csv'", "reads the path 'out.csv' as a table"),
    ("SELECT * FROM read_csv('/etc/passwd')", "calls ['read_csv']"),
    ("SELECT * FROM glob('/*')", "calls ['glob']"),
    ("SELECT pg_read_file('/etc/passwd')", "calls ['pg_read_file']"),
    ("SELECT current_setting('data_directory')", "calls ['current_setting']"),
    ("SELECT * FROM duckdb_settings()", "table functions ['duckdb_settings']"),
    ("SELEC 1", "does not parse"),
])
def test_anything_but_one_select_over_tables_is_refused(sql, message):
    with pytest.raises(SourceError) as refused:
        parse_source({"sql": sql})
    assert message in str(refused.value)


@pytest.mark.parametrize("sql", [
    "SELECT reflect('java.lang.System', 'getenv', 'PASTO_ADMIN_TOKEN') AS arm FROM `events`",
    "SELECT java_method('java.lang.System', 'getenv', 'HOME') AS arm",
    "SELECT * FROM parquet.`/etc`",
])
def test_spark_sql_cannot_reach_the_jvm_or_other_files(sql):
    with pytest.raises(SourceError):
        parse_source({"engine": "spark", "url": "local[1]", "sql": sql})


def test_the_literal_payloads_are_a_422_at_creation(tmp_path, monkeypatch):
    from tests.sources.test_scheduled_rounds import Run, experiment_body

    run = Run(f"sqlite:///{tmp_path / 'pasto.sqlite'}", monkeypatch)
    monkeypatch.chdir(tmp_path)
    for number, sql in enumerate((READ_ENVIRON, COPY_THEN_SELECT)):
        response = run.call("POST", "/api/v1/experiments", json=experiment_body(f"attack-{number}", {"sql": sql}))
        assert response.status_code == 422, response.get_json()
        assert response.get_json()["error"]["details"][0]["location"] == "source"
    assert not (tmp_path / "out.csv").exists()


def _stored(sql: str, **spec) -> source_run.MetricSource:
    """A declaration as stored before the parser check (the check runs again at every run)."""
    return dataclasses.replace(parse_source({"sql": "SELECT 1", **spec}), sql=sql)


def test_the_check_runs_again_at_run_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for sql in (READ_ENVIRON, COPY_THEN_SELECT):
        with pytest.raises(SourceError, match="refused the query: The metric source's SQL"):
            fetch_round_statistics(_stored(sql), "e", WINDOW, ARMS, METRICS)
    assert not (tmp_path / "out.csv").exists()


def test_duckdb_reads_only_the_declared_files_even_without_the_parser_check(tmp_path, monkeypatch):
    import duckdb

    monkeypatch.setattr(source_run, "check_source_sql", lambda sql, engine: None)
    monkeypatch.setenv("PASTO_ADMIN_TOKEN", "secret-admin-token-value")
    declared = tmp_path / "declared"
    declared.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    duckdb.connect().execute(f"COPY (SELECT 'a0' AS arm) TO '{outside / 'private.parquet'}' (FORMAT parquet)")
    duckdb.connect().execute(f"COPY (SELECT 'a0' AS arm) TO '{declared / 'arms.parquet'}' (FORMAT parquet)")
    files = {"arms": {"path": str(declared / "*.parquet")}}
    # The declared view is read.
    ok = ("SELECT arm, 'x' AS metric, count(*) AS count, 0.0 AS sum, 0.0 AS sum_of_squares FROM arms GROUP BY arm")
    result = fetch_round_statistics(_stored(ok, files=files), "e", WINDOW, ARMS, METRICS)
    assert result.statistics.counts.tolist() == [[1.0, 0.0]]
    # The environment, a file outside the declared folder, a write, a settings change: refused by DuckDB.
    for sql in (READ_ENVIRON,
                f"SELECT arm, 'x' AS metric, 1 AS count, 0.0 AS sum, 0.0 AS sum_of_squares "
                f"FROM read_parquet('{outside / 'private.parquet'}')",
                f"SELECT arm, 'x' AS metric, 1 AS count, 0.0 AS sum, 0.0 AS sum_of_squares "
                f"FROM read_parquet('{declared}/../outside/private.parquet')"):
        with pytest.raises(SourceError) as refused:
            fetch_round_statistics(_stored(sql, files=files), "e", WINDOW, ARMS, METRICS)
        assert "disabled by configuration" in str(refused.value)
        assert "secret-admin-token-value" not in str(refused.value)
    with pytest.raises(SourceError):
        fetch_round_statistics(_stored(f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'", files=files), "e", WINDOW,
                               ARMS, METRICS)
    assert not (tmp_path / "out.csv").exists()
    with pytest.raises(SourceError, match="locked"):
        fetch_round_statistics(_stored("SET enable_external_access = true", files=files), "e", WINDOW, ARMS, METRICS)


def test_a_conversion_error_does_not_echo_the_value(tmp_path):
    import duckdb

    duckdb.connect().execute(f"COPY (SELECT 'a0' AS arm, 'customer-4711-secret' AS unit) TO "
                             f"'{tmp_path / 'units.parquet'}' (FORMAT parquet)")
    sql = ("SELECT arm, 'x' AS metric, CAST(unit AS INTEGER) AS count, 0.0 AS sum, 0.0 AS sum_of_squares "
           "FROM units")
    source = parse_source({"files": {"units": {"path": str(tmp_path / "units.parquet")}}, "sql": sql})
    with pytest.raises(SourceError) as refused:
        fetch_round_statistics(source, "e", WINDOW, ARMS, METRICS)
    message = str(refused.value)
    assert message.startswith("The metric source at duckdb:///:memory: refused the query: Conversion Error")
    assert "4711" not in message and "secret" not in message


@pytest.mark.parametrize("text, kept, cut", [
    ("Conversion Error: Could not convert string 'PASTO_ADMIN_TOKEN=abc' to INT32", "Could not convert string",
     "abc"),
    ('invalid input syntax for type integer: "hunter2"', "invalid input syntax", "hunter2"),
    ("[CAST_INVALID_INPUT] The value 'x@y.z' of the type \"STRING\" cannot be cast", "cannot be cast", "x@y.z"),
    ("Out of Range Error: value 123456789012 is out of range", "is out of range", "123456789012"),
])
def test_display_message_cuts_values(text, kept, cut):
    message = display_message(text)
    assert kept in message and cut not in message


@pytest.mark.postgres
def test_postgresql_runs_the_query_read_only_with_a_statement_timeout(postgres_url, monkeypatch):
    engine = sa.create_engine(postgres_url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE SEQUENCE counter"))
        connection.execute(sa.text("CREATE TABLE arms (arm text)"))
        connection.execute(sa.text("INSERT INTO arms VALUES ('a0')"))
    engine.dispose()
    monkeypatch.setenv("PASTO_TEST_WAREHOUSE_URL", postgres_url)
    spec = {"url_env": "PASTO_TEST_WAREHOUSE_URL"}
    # A SELECT that writes (a sequence) fails: the transaction is read-only.
    writes = ("SELECT arm, 'x' AS metric, nextval('counter') AS count, 0.0 AS sum, 0.0 AS sum_of_squares "
              "FROM arms")
    with pytest.raises(SourceError, match="read-only transaction"):
        fetch_round_statistics(parse_source({**spec, "sql": writes}), "e", WINDOW, ARMS, METRICS)
    # Nor can the query's own SELECT turn read-only off first (set_config is refused by the parser check;
    # without it, PostgreSQL refuses it inside the read-only transaction).
    monkeypatch.setattr(source_run, "check_source_sql", lambda sql, engine: None)
    escape = ("SELECT arm, 'x' AS metric, 1 AS count, 0.0 AS sum, 0.0 AS sum_of_squares FROM arms "
              "WHERE set_config('transaction_read_only', 'off', true) = 'off' AND nextval('counter') > 0")
    with pytest.raises(SourceError):
        fetch_round_statistics(_stored(escape, **spec), "e", WINDOW, ARMS, METRICS)
    with sa.create_engine(postgres_url).connect() as connection:
        assert connection.execute(sa.text("SELECT last_value, is_called FROM counter")).one() == (1, False)
    # The statement timeout: a 1 s deadline ends a 30 s query.
    slow = ("SELECT arm, 'x' AS metric, 1 AS count, 0.0 AS sum, 0.0 AS sum_of_squares FROM arms "
            "WHERE pg_sleep(30) IS NOT NULL")
    with pytest.raises(SourceError, match="did not answer within the statement timeout of 1 s"):
        fetch_round_statistics(parse_source({**spec, "sql": slow}), "e", WINDOW, ARMS, METRICS,
                               SourceLimits(connect=5, statement=1))


def test_a_duckdb_query_is_interrupted_at_the_statement_timeout():
    slow = ("SELECT 'a0' AS arm, 'x' AS metric, count(*) AS count, 0.0 AS sum, 0.0 AS sum_of_squares "
            "FROM range(100000000000) t(i) WHERE hash(i) = 42")
    with pytest.raises(SourceError, match="did not answer within the statement timeout of 0.5 s"):
        fetch_round_statistics(parse_source({"sql": slow}), "e", WINDOW, ARMS, METRICS,
                               SourceLimits(connect=5, statement=0.5))


def test_a_declared_relative_path_is_allowed_from_the_working_directory(tmp_path, monkeypatch):
    import duckdb

    monkeypatch.chdir(tmp_path)
    os.mkdir("data")
    duckdb.connect().execute("COPY (SELECT 'a1' AS arm) TO 'data/arms.parquet' (FORMAT parquet)")
    ok = "SELECT arm, 'x' AS metric, count(*) AS count, 0.0 AS sum, 0.0 AS sum_of_squares FROM arms GROUP BY arm"
    source = parse_source({"files": {"arms": {"path": "data/*.parquet"}}, "sql": ok})
    result = fetch_round_statistics(source, "e", WINDOW, ARMS, METRICS)
    assert np.array_equal(result.statistics.counts, [[0.0, 1.0]])
