"""Running a metric source for one round: the query on its engine, the rows checked, a Statistics out.

:func:`fetch_round_statistics` is the whole source step the scheduler runs at a round's update:
resolve the URL's secret, register the file views, run the query (generated from the table mapping,
or the team's SQL template) with the round's bound parameters, and check and shape the rows.
Every failure on the way is a :class:`~service.sources.spec.SourceError` with one sentence that the
scheduler can show; the engine's own message (first line) is kept in it, cut by
:func:`~service.sources.sandbox.display_message` unless it is about the query's text (a parse, name
or catalog error), so that no value a row held is ever echoed.

Sandbox (see :mod:`service.sources.sandbox` for the parser check that runs first): DuckDB runs with
``enable_external_access`` off, only the declared files' directories in ``allowed_directories``, its
configuration locked; PostgreSQL in read-only transactions (``default_transaction_read_only``) with
``statement_timeout``; Spark with SQL on files off, its job interrupted at the statement timeout.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import sqlalchemy as sa

from pasto.estimators import Statistics

from .query import SparkSqlDialect, aggregation_query, compile_query
from .sandbox import check_source_sql, display_message
from .spec import FileTable, MetricSource, SourceError, SourceLimits

__all__ = ["RoundWindow", "RoundStatistics", "fetch_round_statistics", "source_sql", "SQL_RESULT_COLUMNS"]

#: Columns a raw SQL template returns (``units`` is optional).
SQL_RESULT_COLUMNS = ("arm", "metric", "count", "sum", "sum_of_squares")

_PARAMETER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
#: Relative tolerance of the check sum^2 <= count * sum_of_squares (a sum of doubles rounds).
_SQUARES_TOLERANCE = 1e-9


@dataclass(frozen=True)
class RoundWindow:
    """A round: its index and its time window ``[starts_at, ends_at)`` (timezone-aware, UTC)."""

    index: int
    starts_at: datetime
    ends_at: datetime


@dataclass(frozen=True)
class RoundStatistics:
    """One round's statistics from a source.

    Attributes
    ----------
    statistics : Statistics, shape (M, K)
        Per metric and arm: count, sum and sum of squares of the values attributed to the round.
    units : ndarray of int64, shape (K,)
        Distinct units per arm with at least one event in the round (for the SRM check).
    """

    statistics: Statistics
    units: np.ndarray


def _first_line(error: BaseException) -> str:
    original = getattr(error, "orig", None) or error
    text = str(original).strip() or type(original).__name__
    line = text.splitlines()[0].strip()
    return line if len(line) <= 400 else line[:397] + "..."


#: Engine errors about the query's own text (names, syntax, catalog) or the declared files (not found):
#: shown whole. Any other error may quote a value a row held (a failed conversion, an overflow, a CSV
#: line that does not parse) and is cut by ``display_message``.
_QUERY_TEXT_ERRORS = ("ParserException", "BinderException", "CatalogException", "IOException", "SyntaxError",
                      "UndefinedTable", "UndefinedColumn", "UndefinedFunction", "AnalysisException",
                      "ParseException")


def _engine_message(error: BaseException) -> str:
    original = getattr(error, "orig", None) or error
    names = {cls.__name__ for cls in type(original).__mro__}
    sqlstate = getattr(original, "sqlstate", None) or ""
    if names & set(_QUERY_TEXT_ERRORS) or sqlstate.startswith("42"):
        return _first_line(error)
    return display_message(str(original).strip() or type(original).__name__)


def _parameters(experiment: str, window: RoundWindow) -> dict[str, Any]:
    def utc(moment: datetime) -> datetime:
        if moment.tzinfo is None:
            return moment.replace(tzinfo=timezone.utc)
        return moment.astimezone(timezone.utc)

    return {"experiment": experiment, "round_index": int(window.index),
            "starts_at": utc(window.starts_at), "ends_at": utc(window.ends_at)}


def _used(sql: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    # Only the parameters the text names: Spark refuses unused named arguments in some versions,
    # and a template need not use all four.
    names = set(_PARAMETER.findall(sql))
    return {name: value for name, value in parameters.items() if name in names}


def source_sql(source: MetricSource, metrics: Sequence[str], dialect: sa.engine.Dialect | None = None) -> str:
    """The SQL text the source runs for a round (for docs, diagnostics and benchmarks).

    Parameters
    ----------
    source : MetricSource
    metrics : sequence of str, length M
    dialect : sqlalchemy Dialect, optional
        The engine's dialect; Spark SQL for a Spark source when omitted.
    """
    if source.sql is not None:
        return source.sql
    if dialect is None:
        dialect = SparkSqlDialect()
    return compile_query(aggregation_query(source.mapping, metrics), dialect)


# ---------------------------------------------------------------------------------------------- engines


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _allowed_directories(files: Iterable[FileTable]) -> list[str]:
    """The directories DuckDB may read: each declared path's folder (up to its first glob character)."""
    folders = []
    for table in files:
        path = os.path.abspath(table.path)
        fixed = re.split(r"[*?\[{]", path, maxsplit=1)[0]
        folder = fixed if fixed.endswith(os.sep) else os.path.dirname(fixed) + os.sep
        folders.append(folder)
    return sorted(set(folders))


def _connect_arguments(backend: str, limits: SourceLimits) -> dict[str, Any]:
    if backend == "postgresql":
        # Every transaction of the session is read-only, and every statement has a deadline, from the
        # first statement on: set at connect, not by a statement the query could follow with another.
        return {"connect_timeout": max(1, math.ceil(limits.connect)),
                "options": f"-c default_transaction_read_only=on "
                           f"-c statement_timeout={max(1, int(limits.statement * 1000))}"}
    return {}


def _sandbox_duckdb(connection, files: Iterable[FileTable]) -> None:
    """No file, network or extension outside the declared files' folders; settings locked."""
    folders = ", ".join(_quote_literal(folder) for folder in _allowed_directories(files))
    connection.exec_driver_sql(f"SET allowed_directories = [{folders}]")
    connection.exec_driver_sql("SET enable_external_access = false")
    connection.exec_driver_sql("SET lock_configuration = true")


class _Deadline:
    """Interrupt a running query after ``seconds`` (engines without a server-side statement timeout)."""

    def __init__(self, seconds: float, interrupt) -> None:
        self.expired = False
        self._interrupt = interrupt
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.expired = True
        try:
            self._interrupt()
        except Exception:  # the query ended meanwhile; nothing to interrupt
            pass

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._timer.cancel()


def _run_sqlalchemy(source: MetricSource, metrics: Sequence[str], parameters: Mapping[str, Any],
                    limits: SourceLimits) -> tuple[list[str], list[tuple]]:
    url = source.resolved_url()
    try:
        backend = sa.engine.make_url(url).get_backend_name()
        engine = sa.create_engine(url, connect_args=_connect_arguments(backend, limits), poolclass=sa.pool.NullPool)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError, ValueError) as error:
        raise SourceError(
            f"pasto cannot open the metric source's URL {source.describe_url()} ({_first_line(error)}); "
            "is the engine's SQLAlchemy dialect installed?") from None
    deadline = None
    try:
        if source.sql is not None:
            try:
                check_source_sql(source.sql, backend)
            except SourceError as error:
                raise SourceError(f"The metric source at {source.describe_url()} refused the query: {error}") from None
        with engine.connect() as connection:
            if backend == "duckdb":
                connection.exec_driver_sql("SET TimeZone = 'UTC'")
                _sandbox_duckdb(connection, source.files)
                for table in source.files:
                    reader = "read_parquet" if table.format == "parquet" else "read_csv_auto"
                    connection.exec_driver_sql(
                        f'CREATE OR REPLACE TEMP VIEW "{table.name}" AS '
                        f"SELECT * FROM {reader}({_quote_literal(table.path)})")
            elif source.files:
                raise SourceError(
                    f"The metric source's \"files\" are read by DuckDB and Spark only, not {backend}.")
            elif backend == "postgresql":
                # Timestamps without a zone in the tables are UTC, compared with the UTC window.
                connection.exec_driver_sql("SET TIME ZONE 'UTC'")
            if backend in ("duckdb", "postgresql"):
                # The session is in UTC, so a zone-less UTC window compares right with both TIMESTAMP and
                # TIMESTAMPTZ columns; a zoned parameter would make DuckDB cast every row's TIMESTAMP to
                # TIMESTAMPTZ (measured: 1.7x the time of the whole query on 10^6 events).
                parameters = {key: value.replace(tzinfo=None) if isinstance(value, datetime) else value
                              for key, value in parameters.items()}
            if backend == "duckdb":
                # DuckDB has no statement timeout of its own: the query is interrupted from a timer.
                deadline = _Deadline(limits.statement, connection.connection.driver_connection.interrupt)
            with deadline or _NoDeadline():
                if source.sql is not None:
                    result = connection.execute(sa.text(source.sql), _used(source.sql, parameters))
                else:
                    query = aggregation_query(source.mapping, metrics)
                    names = set(query.compile().params)
                    result = connection.execute(query, {k: v for k, v in parameters.items() if k in names})
                columns = list(result.keys())
                rows = [tuple(row) for row in result]
            connection.rollback()
            return columns, rows
    except SourceError:
        raise
    except sa.exc.SQLAlchemyError as error:
        if deadline is not None and deadline.expired or _statement_timeout(error):
            raise SourceError(
                f"The metric source at {source.describe_url()} did not answer within the statement timeout "
                f"of {limits.statement:g} s (PASTO_SOURCE_STATEMENT_TIMEOUT).") from None
        kind = "could not be reached" if isinstance(error, sa.exc.OperationalError) and _unreachable(error) \
            else "refused the query"
        raise SourceError(
            f"The metric source at {source.describe_url()} {kind}: {_engine_message(error)}") from None
    finally:
        engine.dispose()


class _NoDeadline:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        return None


def _statement_timeout(error: sa.exc.SQLAlchemyError) -> bool:
    return getattr(getattr(error, "orig", None), "sqlstate", None) == "57014"  # query_canceled


def _unreachable(error: sa.exc.OperationalError) -> bool:
    text = str(getattr(error, "orig", error)).lower()
    return any(word in text for word in ("connection", "connect", "could not translate host", "timeout"))


def spark_session(url: str):
    """The SparkSession for ``url``: the active one if there is one, else a new one.

    ``local[N]`` / ``spark://`` / ``yarn`` start a classic session with the UI off and few shuffle
    partitions (a round's aggregation has one row per arm); ``sc://`` connects through Spark Connect
    (needs ``pyspark[connect]``).
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise SourceError("The metric source runs on Spark, but PySpark is not installed "
                          "(pip install 'pasto[warehouse]').") from None
    if url.startswith("sc://"):
        return SparkSession.builder.remote(url).getOrCreate()
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    return (SparkSession.builder.master(url).appName("pasto-metric-source")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate())


def _register_spark_files(spark, files: Iterable[FileTable]) -> None:
    for table in files:
        reader = spark.read
        if table.format == "csv":
            frame = reader.option("header", "true").option("inferSchema", "true").csv(table.path)
        else:
            frame = reader.parquet(table.path)
        frame.createOrReplaceTempView(table.name)


def _run_spark(source: MetricSource, metrics: Sequence[str], parameters: Mapping[str, Any],
               limits: SourceLimits) -> tuple[list[str], list[tuple]]:
    try:
        from pyspark.errors import PySparkException
        from py4j.protocol import Py4JError
    except ImportError:
        raise SourceError("The metric source runs on Spark, but PySpark is not installed "
                          "(pip install 'pasto[warehouse]').") from None
    url = source.resolved_url()
    if source.sql is not None:
        try:
            check_source_sql(source.sql, "spark")
        except SourceError as error:
            raise SourceError(f"The Spark metric source at {source.describe_url()} failed: {error}") from None
    deadline = None
    tag = f"pasto-source-{threading.get_ident()}-{id(parameters)}"
    try:
        spark = spark_session(url)
        # Zone-less timestamps in the files are UTC, as on the other engines (Spark Connect too).
        spark.conf.set("spark.sql.session.timeZone", "UTC")
        # No `SELECT ... FROM parquet.`/any/path``: the declared files are the only ones read.
        spark.conf.set("spark.sql.runSQLOnFiles", "false")
        _register_spark_files(spark, source.files)
        text = source_sql(source, metrics)
        spark.addTag(tag)
        deadline = _Deadline(limits.statement, lambda: spark.interruptTag(tag))
        try:
            with deadline:
                frame = spark.sql(text, args=_used(text, parameters))
                columns = list(frame.columns)
                rows = [tuple(row) for row in frame.collect()]
        finally:
            spark.removeTag(tag)
        return columns, rows
    except SourceError:
        raise
    except (PySparkException, Py4JError, ValueError, OSError) as error:
        if deadline is not None and deadline.expired:
            raise SourceError(
                f"The Spark metric source at {source.describe_url()} did not answer within the statement "
                f"timeout of {limits.statement:g} s (PASTO_SOURCE_STATEMENT_TIMEOUT).") from None
        raise SourceError(f"The Spark metric source at {source.describe_url()} failed: "
                          f"{_engine_message(error)}") from None


# ---------------------------------------------------------------------------------------------- results


def _number(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SourceError(f"The metric source returned a {what} of type {type(value).__name__}, which is not a "
                          "number.") from None
    if not math.isfinite(number):
        raise SourceError(f"The metric source returned a {what} which is not finite.")
    return number


def _arm_position(arm: Any, positions: Mapping[str, int]) -> int:
    position = positions.get(str(arm))
    if position is None:
        raise SourceError(
            f"The metric source returned an arm which is not one of the experiment's arms {list(positions)}.")
    return position


def _check_cell(count: float, total: float, squares: float, where: str) -> None:
    if count < 0 or count != int(count):
        raise SourceError(f"The metric source returned a count for {where} that is not a whole number >= 0.")
    if squares < 0 or total * total > count * squares * (1 + _SQUARES_TOLERANCE) + 1e-12:
        raise SourceError(f"The metric source returned a sum and a sum_of_squares for {where}; no real values "
                          "have them.")
    if count == 0 and (total != 0 or squares != 0):
        raise SourceError(f"The metric source returned a sum without values (count = 0) for {where}.")


def _shape_wide(columns: list[str], rows: list[tuple], arms: Sequence[str],
                metrics: Sequence[str]) -> RoundStatistics:
    positions = {name: k for k, name in enumerate(arms)}
    index = {name: i for i, name in enumerate(columns)}
    counts, sums, squares = (np.zeros((len(metrics), len(arms))) for _ in range(3))
    units = np.zeros(len(arms), dtype=np.int64)
    for row in rows:
        k = _arm_position(row[index["arm"]], positions)
        units[k] += int(_number(row[index["units"]], "units"))
        for m, metric in enumerate(metrics):
            count = _number(row[index[f"count_{m}"]], "count")
            total = _number(row[index[f"sum_{m}"]] or 0.0, "sum")
            square = _number(row[index[f"sum_of_squares_{m}"]] or 0.0, "sum_of_squares")
            _check_cell(count, total, square, f"arm {arms[k]!r}, metric {metric!r}")
            counts[m, k] += count
            sums[m, k] += total
            squares[m, k] += square
    return RoundStatistics(Statistics(counts, sums, squares), units)


def _shape_long(columns: list[str], rows: list[tuple], arms: Sequence[str],
                metrics: Sequence[str]) -> RoundStatistics:
    lowered = [name.lower() for name in columns]
    missing = [name for name in SQL_RESULT_COLUMNS if name not in lowered]
    if missing:
        raise SourceError(
            f"The metric source's SQL returned the columns {columns}, without {missing}; it must return "
            "arm, metric, count, sum and sum_of_squares (and optionally units).")
    index = {name: lowered.index(name) for name in (*SQL_RESULT_COLUMNS, "units") if name in lowered}
    arm_positions = {name: k for k, name in enumerate(arms)}
    metric_positions = {name: m for m, name in enumerate(metrics)}
    counts, sums, squares = (np.zeros((len(metrics), len(arms))) for _ in range(3))
    units = np.zeros(len(arms), dtype=np.int64)
    units_seen: dict[int, int] = {}
    seen: set[tuple[int, int]] = set()
    for row in rows:
        k = _arm_position(row[index["arm"]], arm_positions)
        metric = row[index["metric"]]
        m = metric_positions.get(str(metric))
        if m is None:
            raise SourceError(
                f"The metric source returned a metric which is not one of the experiment's metrics "
                f"{list(metrics)}.")
        if (m, k) in seen:
            raise SourceError(f"The metric source returned two rows for arm {arms[k]!r} and metric "
                              f"{metrics[m]!r}; its SQL must GROUP BY arm and metric.")
        seen.add((m, k))
        count = _number(row[index["count"]], "count")
        total = _number(row[index["sum"]] if row[index["sum"]] is not None else 0.0, "sum")
        square = _number(row[index["sum_of_squares"]] if row[index["sum_of_squares"]] is not None else 0.0,
                         "sum_of_squares")
        _check_cell(count, total, square, f"arm {arms[k]!r}, metric {metrics[m]!r}")
        counts[m, k], sums[m, k], squares[m, k] = count, total, square
        if "units" in index:
            unit_count = int(_number(row[index["units"]], "units"))
            if units_seen.setdefault(k, unit_count) != unit_count:
                raise SourceError(f"The metric source returned different units for arm {arms[k]!r} on "
                                  "different metrics; units counts the arm's distinct units once.")
            units[k] = unit_count
    return RoundStatistics(Statistics(counts, sums, squares), units)


def fetch_round_statistics(source: MetricSource, experiment: str, window: RoundWindow,
                           arms: Sequence[str], metrics: Sequence[str],
                           limits: SourceLimits = SourceLimits()) -> RoundStatistics:
    """One round's statistics from ``source``: the source step of a round's update.

    Parameters
    ----------
    source : MetricSource
    experiment : str
        The experiment's name (the ``:experiment`` parameter).
    window : RoundWindow
        The round (``:round_index``, ``:starts_at``, ``:ends_at``).
    arms : sequence of str, length K
        The experiment's arm names in arm order; the source's arm values are matched as text.
    metrics : sequence of str, length M
        The experiment's metric names in metric order.
    limits : SourceLimits
        The connect and statement timeouts.

    Returns
    -------
    RoundStatistics
        Statistics of shape (M, K) (zeros where the source has no row) and units of shape (K,).

    Raises
    ------
    SourceError
        When the engine cannot be reached, refuses the query, or returns rows pasto cannot use.
    """
    parameters = _parameters(experiment, window)
    if source.engine == "spark":
        columns, rows = _run_spark(source, metrics, parameters, limits)
    else:
        columns, rows = _run_sqlalchemy(source, metrics, parameters, limits)
    if source.sql is not None:
        return _shape_long(columns, rows, arms, metrics)
    return _shape_wide(columns, rows, arms, metrics)
