"""Warehouse-native metric sources: a round's sufficient statistics computed where the events are.

An experiment may declare a metric source (:func:`parse_source`); at a round's update the scheduler
calls :func:`fetch_round_statistics`, which runs one GROUP BY on the source's engine (DuckDB over
Parquet/CSV files, PostgreSQL, Spark, or any SQLAlchemy dialect) and returns the round's per-(metric,
arm) count, sum and sum of squares plus distinct units per arm. Only those aggregates leave the engine.
Every failure is a :class:`SourceError` whose message is one sentence. See docs/scaling.md.
"""

from .query import SparkSqlDialect, aggregation_query, compile_query
from .run import RoundStatistics, RoundWindow, fetch_round_statistics, source_sql, spark_session
from .spec import MetricSource, SourceError, SourceLimits, parse_source

__all__ = [
    "MetricSource",
    "RoundStatistics",
    "RoundWindow",
    "SourceError",
    "SourceLimits",
    "SparkSqlDialect",
    "aggregation_query",
    "compile_query",
    "fetch_round_statistics",
    "parse_source",
    "source_sql",
    "spark_session",
]
