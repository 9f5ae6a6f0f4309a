"""The aggregation a table mapping stands for, as one SQLAlchemy Core GROUP BY query.

Attribution rule (one round, window ``[starts_at, ends_at)``):

1. The round's exposures are the exposure rows of the experiment (when the table has an experiment
   column) whose round column equals the round's index, or, without a round column, whose timestamp
   falls in the window.
2. A unit counts once per round, in the arm of its **first** exposure of the round (earliest
   timestamp, ties broken by the smaller arm name; without timestamps, the smaller arm name). pasto
   assigns a unit one arm per round, so later exposures of the same unit repeat the first.
3. An event belongs to the round when its unit has such an exposure, its timestamp falls in the
   window, and (when exposures have timestamps) it is not earlier than that first exposure: an event
   before the unit saw its arm cannot have been caused by it. With a round column and timestamps, the
   window ends no earlier than the round's last exposure (its events up to that instant included): a
   round is served until every process has seen its close (an assignment answered from a snapshot
   that was not yet refreshed, a request in flight at the close), and what was served in round r
   counts in round r however late that was.
4. Per arm and metric: ``count`` = events with a non-NULL value of the metric's column, ``sum`` and
   ``sum_of_squares`` of that value as a double; per arm, ``units`` = distinct units with at least one
   event in the round (the service's definition for observations sent through the webhook).

The query has bound parameters ``:experiment``, ``:round_index``, ``:starts_at`` and ``:ends_at``
(those the mapping uses); :func:`compile_query` renders it for an SQLAlchemy dialect or as Spark SQL
text with the same ``:name`` parameter markers (``SparkSession.sql(text, args=...)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import default
from sqlalchemy.sql import compiler

from .spec import SourceError, TableMapping

__all__ = ["aggregation_query", "compile_query", "SparkSqlDialect", "metric_columns"]


def _table(qualified: str, columns: Sequence[str]) -> sa.TableClause:
    parts = qualified.split(".")
    schema = ".".join(parts[:-1]) or None
    return sa.table(parts[-1], *(sa.column(name) for name in dict.fromkeys(columns)), schema=schema)


def metric_columns(mapping: TableMapping, metrics: Sequence[str]) -> list[str]:
    """The event column of each experiment metric, in the experiment's order.

    Raises
    ------
    SourceError
        When the mapping has no column for one of the metrics.
    """
    missing = [metric for metric in metrics if mapping.events.column_of(metric) is None]
    if missing:
        raise SourceError(
            f"The metric source's mapping.events.metrics has no column for the experiment's metrics "
            f"{missing}.")
    return [mapping.events.column_of(metric) for metric in metrics]


def aggregation_query(mapping: TableMapping, metrics: Sequence[str]) -> sa.Select:
    """The round's GROUP BY query for ``mapping``.

    Parameters
    ----------
    mapping : TableMapping
    metrics : sequence of str, length M
        The experiment's metrics; metric ``i``'s aggregates are the columns ``count_i``, ``sum_i`` and
        ``sum_of_squares_i``.

    Returns
    -------
    sqlalchemy.Select
        Columns ``arm``, ``units``, then ``count_i, sum_i, sum_of_squares_i`` for i < M; one row per arm.
    """
    columns = metric_columns(mapping, metrics)
    exposure = mapping.exposures
    event = mapping.events
    exposures = _table(exposure.table, [c for c in (exposure.unit, exposure.arm, exposure.experiment,
                                                    exposure.round, exposure.timestamp) if c])
    events = _table(event.table, [event.unit, event.timestamp, *columns])
    starts_at = sa.bindparam("starts_at")
    ends_at = sa.bindparam("ends_at")

    conditions = []
    if exposure.experiment is not None:
        conditions.append(exposures.c[exposure.experiment] == sa.bindparam("experiment"))
    if exposure.round is not None:
        conditions.append(exposures.c[exposure.round] == sa.bindparam("round_index"))
    else:
        conditions += [exposures.c[exposure.timestamp] >= starts_at, exposures.c[exposure.timestamp] < ends_at]
    order = ([exposures.c[exposure.timestamp]] if exposure.timestamp is not None else []) + [exposures.c[exposure.arm]]
    ranked_columns = [
        exposures.c[exposure.unit].label("unit"),
        exposures.c[exposure.arm].label("arm"),
        sa.func.row_number().over(partition_by=exposures.c[exposure.unit], order_by=order).label("exposure_rank"),
    ]
    labelled = exposure.round is not None and exposure.timestamp is not None
    if exposure.timestamp is not None:
        ranked_columns.append(exposures.c[exposure.timestamp].label("exposed_at"))
    if labelled:
        ranked_columns.append(sa.func.max(exposures.c[exposure.timestamp]).over().label("served_until"))
    ranked = sa.select(*ranked_columns).where(*conditions).subquery("round_exposures")

    event_time = events.c[event.timestamp]
    join_on = [
        ranked.c.unit == events.c[event.unit],
        ranked.c.exposure_rank == sa.literal_column("1"),
        event_time >= starts_at,
        sa.or_(event_time < ends_at, event_time <= ranked.c.served_until) if labelled else event_time < ends_at,
    ]
    if exposure.timestamp is not None:
        join_on.append(events.c[event.timestamp] >= ranked.c.exposed_at)

    aggregates = [sa.func.count(sa.distinct(ranked.c.unit)).label("units")]
    for i, column in enumerate(columns):
        value = sa.cast(events.c[column], sa.Double)
        aggregates += [
            sa.func.count(events.c[column]).label(f"count_{i}"),
            sa.func.sum(value).label(f"sum_{i}"),
            sa.func.sum(value * value).label(f"sum_of_squares_{i}"),
        ]
    return (
        sa.select(ranked.c.arm, *aggregates)
        .select_from(ranked.join(events, sa.and_(*join_on)))
        .group_by(ranked.c.arm)
    )


class _SparkIdentifierPreparer(compiler.IdentifierPreparer):
    def __init__(self, dialect: default.DefaultDialect) -> None:
        super().__init__(dialect, initial_quote="`", escape_quote="`")


class _SparkTypeCompiler(compiler.GenericTypeCompiler):
    def visit_DOUBLE(self, type_, **kw):  # noqa: N802 - SQLAlchemy's visitor name
        return "DOUBLE"

    def visit_double(self, type_, **kw):
        return "DOUBLE"


class SparkSqlDialect(default.DefaultDialect):
    """Enough of a dialect to render Core SELECTs as Spark SQL: backquoted names, ``:name`` parameters.

    The generic compiler's SELECT, JOIN, CASE, window functions and CAST are Spark SQL as they are.
    """

    name = "spark_sql"
    preparer = _SparkIdentifierPreparer
    type_compiler_cls = _SparkTypeCompiler
    default_paramstyle = "named"


def compile_query(query: sa.Select, dialect: sa.engine.Dialect) -> str:
    """The SQL text of ``query`` for ``dialect`` (with its bound-parameter markers, no values inlined)."""
    return str(query.compile(dialect=dialect))
