"""The generated aggregation compiles for several SQLAlchemy dialects and as Spark SQL, with the same shape."""

from __future__ import annotations

import pytest
from sqlalchemy.dialects import mssql, oracle, postgresql

from service.sources import SparkSqlDialect, parse_source, source_sql


@pytest.fixture
def source(eventdata):
    mapping = eventdata.mapping_spec("analytics.exposure_log", "analytics.events")
    return parse_source({"url": "duckdb:///:memory:", "mapping": mapping})


@pytest.mark.parametrize("dialect", [postgresql.dialect(), mssql.dialect(), oracle.dialect(),
                                     SparkSqlDialect()], ids=lambda d: d.name)
def test_one_group_by_with_the_attribution_rule(source, dialect):
    sql = source_sql(source, ["y", "x"], dialect)
    compact = " ".join(sql.split()).lower()
    for quote in ('`', '"', "[", "]"):
        compact = compact.replace(quote, "")
    assert compact.count("group by") == 1 and "row_number() over (partition by" in compact
    assert "from analytics.exposure_log" in compact and "join analytics.events on" in compact
    # metric order follows the experiment's: y first
    assert compact.index("count(analytics.events.y)") < compact.index("count(analytics.events.x)")


def test_spark_sql_uses_named_markers_and_backquotes(source):
    sql = source_sql(source, ["x"])
    for name in (":experiment", ":round_index", ":starts_at", ":ends_at"):
        assert name in sql
    assert "%(" not in sql and "?" not in sql
    assert "CAST(analytics.events.x AS DOUBLE)" in sql


def test_a_mapping_without_timestamps_selects_exposures_by_window(eventdata):
    mapping = eventdata.mapping_spec()
    del mapping["exposures"]["timestamp"], mapping["exposures"]["round"]
    mapping["exposures"]["timestamp"] = "ts"
    sql = " ".join(source_sql(parse_source({"mapping": mapping}), ["x"]).split())
    assert "exposures.ts >= :starts_at AND exposures.ts < :ends_at" in sql and ":round_index" not in sql
