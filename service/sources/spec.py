"""A metric source's declaration: where a round's events are and how to read them.

An experiment declares its source as a JSON object (stored in its configuration, so it never holds a
secret); :func:`parse_source` turns it into a :class:`MetricSource` or raises :class:`SourceError`.

Engines
    ``"engine": "sqlalchemy"`` (the default) runs on any SQLAlchemy URL: ``duckdb:///:memory:`` (the
    default URL: DuckDB in-process over Parquet/CSV files), ``postgresql+psycopg://...``, or any other
    installed dialect (BigQuery, Snowflake, ClickHouse, Trino, Databricks, Redshift).
    ``"engine": "spark"`` runs Spark SQL through PySpark: ``"url": "local[2]"`` (an in-process Spark)
    or ``"url": "sc://host:15002"`` (Spark Connect to a cluster).

Secrets
    ``url_env`` names an environment variable holding the whole URL; ``password_env`` names one holding
    the password of ``url``. A ``url`` with a password in it is refused: the declaration is stored in
    the database and shown by the API.

Files
    ``files`` maps a table name to ``{"path": ..., "format": "parquet" | "csv"}``; on DuckDB and Spark
    the name is registered as a temporary view over the files (a glob reads a folder of them) before
    each query, so rows that landed since the previous query are read.

Late rows
    ``late_rounds`` (default 1): each round update also re-runs the query of that many rounds before
    it, whose updates already ran; rows that landed there since are counted as late (as late
    observations of the webhook are). The round just before is re-run even with ``late_rounds = 0``:
    what was served while its close committed landed after its update's query.

Forms
    ``mapping`` (exposure and event tables, see :class:`TableMapping`), from which pasto generates one
    GROUP BY query, or ``sql``: a query of the team's own with the bound parameters ``:experiment``,
    ``:round_index``, ``:starts_at`` and ``:ends_at`` returning the columns ``arm, metric, count, sum,
    sum_of_squares`` and optionally ``units``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

__all__ = [
    "SourceError",
    "FileTable",
    "ExposureTable",
    "EventTable",
    "TableMapping",
    "MetricSource",
    "parse_source",
    "SQL_PARAMETERS",
    "SourceLimits",
]

#: Most applied rounds one update re-queries for late rows (each is one query on the engine).
MAX_LATE_ROUNDS = 24

#: The bound parameters a raw SQL template may use.
SQL_PARAMETERS = ("experiment", "round_index", "starts_at", "ends_at")

_ENGINES = ("sqlalchemy", "spark")
_FILE_FORMATS = ("parquet", "csv")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$-]*(\.[A-Za-z_][A-Za-z0-9_$-]*){0,2}$")


class SourceError(Exception):
    """A metric source could not give a round's statistics; the message is one sentence for people.

    Raised for a declaration pasto cannot use, an engine it cannot reach, SQL the engine refuses,
    and a result with missing columns or values pasto cannot use.
    """


@dataclass(frozen=True)
class SourceLimits:
    """Deadlines, in seconds, of a source query (``PASTO_SOURCE_CONNECT_TIMEOUT``,
    ``PASTO_SOURCE_STATEMENT_TIMEOUT``; see docs/scaling.md).

    ``connect``: opening the engine's connection (PostgreSQL's ``connect_timeout``). ``statement``:
    the query itself (PostgreSQL's ``statement_timeout``; DuckDB and Spark: the query is interrupted).
    """

    connect: float = 10.0
    statement: float = 300.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SourceLimits:
        return cls(connect=float(config["PASTO_SOURCE_CONNECT_TIMEOUT"]),
                   statement=float(config["PASTO_SOURCE_STATEMENT_TIMEOUT"]))


@dataclass(frozen=True)
class FileTable:
    """Files registered as a temporary view named ``name`` before each query (DuckDB and Spark)."""

    name: str
    path: str
    format: str


@dataclass(frozen=True)
class ExposureTable:
    """Columns of the exposure table: one row per (unit, assignment).

    ``round`` (the round index) or ``timestamp`` (the exposure time) or both must be given; with only
    ``timestamp`` the round's exposures are those with a time in the round's window. ``experiment``
    may be omitted when the table holds one experiment only.
    """

    table: str
    unit: str
    arm: str
    experiment: str | None = None
    round: str | None = None
    timestamp: str | None = None


@dataclass(frozen=True)
class EventTable:
    """Columns of the event table: a unit, a timestamp, and one column per metric.

    ``metrics`` maps an experiment metric name to its column (pairs in declaration order). A NULL in a
    metric column means that metric was not observed by that event.
    """

    table: str
    unit: str
    timestamp: str
    metrics: tuple[tuple[str, str], ...]

    def column_of(self, metric: str) -> str | None:
        return dict(self.metrics).get(metric)


@dataclass(frozen=True)
class TableMapping:
    """An exposure table and an event table (see :mod:`service.sources.query` for the attribution rule)."""

    exposures: ExposureTable
    events: EventTable


@dataclass(frozen=True)
class MetricSource:
    """A parsed metric source declaration (see the module docstring for the JSON it comes from)."""

    engine: str
    url: str | None
    url_env: str | None
    password_env: str | None
    files: tuple[FileTable, ...]
    mapping: TableMapping | None
    sql: str | None
    late_rounds: int = 1

    def resolved_url(self) -> str:
        """The URL with its secret filled in from the environment.

        Raises
        ------
        SourceError
            When a named environment variable is not set.
        """
        if self.url_env is not None:
            url = os.environ.get(self.url_env)
            if not url:
                raise SourceError(
                    f"The environment variable {self.url_env} (the metric source's URL) is not set.")
        else:
            url = self.url or ("duckdb:///:memory:" if self.engine == "sqlalchemy" else "local[1]")
        if self.password_env is not None:
            password = os.environ.get(self.password_env)
            if password is None:
                raise SourceError(
                    f"The environment variable {self.password_env} (the metric source's password) "
                    "is not set.")
            try:
                url = sa.engine.make_url(url).set(password=password).render_as_string(hide_password=False)
            except (sa.exc.ArgumentError, ValueError):
                raise SourceError(f"The metric source's URL {self.describe_url()} is not an SQLAlchemy URL.") from None
        return url

    def describe_url(self) -> str:
        """The URL as it may be shown: the variable's name instead of a URL held in the environment."""
        if self.url_env is not None:
            return f"${self.url_env}"
        return self.url or ("duckdb:///:memory:" if self.engine == "sqlalchemy" else "local[1]")


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SourceError(f"The metric source's {where} must be a JSON object.")
    return value


def _string(spec: Mapping[str, Any], key: str, where: str, *, required: bool,
            pattern: re.Pattern[str] | None = None) -> str | None:
    value = spec.get(key)
    if value is None:
        if required:
            raise SourceError(f"The metric source's {where} needs a \"{key}\".")
        return None
    if not isinstance(value, str) or not value.strip():
        raise SourceError(f"The metric source's {where} \"{key}\" must be a non-empty string.")
    if pattern is not None and not pattern.match(value):
        raise SourceError(
            f"The metric source's {where} \"{key}\" ({value!r}) must be a plain SQL name "
            "(letters, digits and underscores; a table may be qualified by schema and catalog).")
    return value


def _unknown_keys(spec: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise SourceError(
            f"The metric source's {where} has unknown keys {unknown}; allowed: {list(allowed)}.")


def _parse_mapping(spec: Mapping[str, Any]) -> TableMapping:
    _unknown_keys(spec, ("exposures", "events"), "mapping")
    exposures = _object(spec.get("exposures"), "mapping.exposures")
    events = _object(spec.get("events"), "mapping.events")
    where = "mapping.exposures"
    _unknown_keys(exposures, ("table", "unit", "arm", "experiment", "round", "timestamp"), where)
    exposure_table = ExposureTable(
        table=_string(exposures, "table", where, required=True, pattern=_DOTTED_NAME),
        unit=_string(exposures, "unit", where, required=True, pattern=_NAME),
        arm=_string(exposures, "arm", where, required=True, pattern=_NAME),
        experiment=_string(exposures, "experiment", where, required=False, pattern=_NAME),
        round=_string(exposures, "round", where, required=False, pattern=_NAME),
        timestamp=_string(exposures, "timestamp", where, required=False, pattern=_NAME),
    )
    if exposure_table.round is None and exposure_table.timestamp is None:
        raise SourceError(
            "The metric source's mapping.exposures needs a \"round\" column, a \"timestamp\" column "
            "or both, to find each round's exposures.")
    where = "mapping.events"
    _unknown_keys(events, ("table", "unit", "timestamp", "metrics"), where)
    metrics = _object(events.get("metrics"), "mapping.events.metrics")
    if not metrics:
        raise SourceError("The metric source's mapping.events.metrics must map at least one metric to a column.")
    pairs = []
    for metric, column in metrics.items():
        if not isinstance(column, str) or not _NAME.match(column):
            raise SourceError(
                f"The metric source's mapping.events.metrics maps {metric!r} to {column!r}; "
                "it must be a plain column name.")
        pairs.append((str(metric), column))
    event_table = EventTable(
        table=_string(events, "table", where, required=True, pattern=_DOTTED_NAME),
        unit=_string(events, "unit", where, required=True, pattern=_NAME),
        timestamp=_string(events, "timestamp", where, required=True, pattern=_NAME),
        metrics=tuple(pairs),
    )
    return TableMapping(exposure_table, event_table)


def _parse_files(spec: Any) -> tuple[FileTable, ...]:
    if spec is None:
        return ()
    files = []
    for name, entry in _object(spec, "files").items():
        if not _NAME.match(str(name)):
            raise SourceError(f"The metric source's file table name {name!r} must be a plain SQL name.")
        entry = _object(entry, f"files.{name}")
        _unknown_keys(entry, ("path", "format"), f"files.{name}")
        path = _string(entry, "path", f"files.{name}", required=True)
        file_format = entry.get("format", "parquet")
        if file_format not in _FILE_FORMATS:
            raise SourceError(
                f"The metric source's files.{name} format is {file_format!r}; pasto reads "
                f"{' and '.join(_FILE_FORMATS)}.")
        files.append(FileTable(str(name), path, file_format))
    return tuple(files)


def parse_source(spec: Any) -> MetricSource:
    """Validate a metric source declaration.

    Parameters
    ----------
    spec : mapping
        The declaration (JSON object): ``engine``, ``url`` or ``url_env``, ``password_env``,
        ``files``, ``late_rounds``, and exactly one of ``mapping`` or ``sql``.

    Returns
    -------
    MetricSource

    Raises
    ------
    SourceError
        When the declaration is incomplete, names an unknown engine, holds a password, or its ``sql`` is
        not one read-only SELECT over tables (:func:`service.sources.sandbox.check_source_sql`).
    """
    spec = _object(spec, "declaration")
    _unknown_keys(spec, ("engine", "url", "url_env", "password_env", "files", "mapping", "sql",
                         "late_rounds"), "declaration")
    engine = spec.get("engine", "sqlalchemy")
    if engine not in _ENGINES:
        raise SourceError(f"The metric source's engine is {engine!r}; pasto runs {' and '.join(_ENGINES)}.")
    url = _string(spec, "url", "declaration", required=False)
    url_env = _string(spec, "url_env", "declaration", required=False, pattern=_NAME)
    password_env = _string(spec, "password_env", "declaration", required=False, pattern=_NAME)
    if url is not None and url_env is not None:
        raise SourceError("The metric source declares both \"url\" and \"url_env\"; give one of them.")
    if engine == "sqlalchemy" and url is not None:
        try:
            parsed = sa.engine.make_url(url)
        except (sa.exc.ArgumentError, ValueError) as error:  # ValueError: a port that is not a number
            raise SourceError(f"The metric source's URL {url!r} is not an SQLAlchemy URL ({error}).") from None
        if parsed.password is not None:
            raise SourceError(
                "The metric source's URL contains a password; the declaration is stored and shown, so "
                "put the password in an environment variable and name it in \"password_env\".")
    if engine == "spark" and password_env is not None:
        raise SourceError(
            "A Spark metric source takes no \"password_env\"; put a Spark Connect URL with its token "
            "in an environment variable and name it in \"url_env\".")
    if engine == "spark" and url is not None and not (url.startswith("local") or url.startswith("sc://")
                                                       or url.startswith("spark://") or url == "yarn"):
        raise SourceError(
            f"The Spark metric source's URL {url!r} must be a master (local[N], spark://, yarn) or a "
            "Spark Connect URL (sc://host:port).")
    if ("mapping" in spec) == ("sql" in spec):
        raise SourceError("The metric source needs exactly one of \"mapping\" (exposure and event tables) "
                          "or \"sql\" (a query returning arm, metric, count, sum, sum_of_squares).")
    mapping = _parse_mapping(_object(spec["mapping"], "mapping")) if "mapping" in spec else None
    sql = _string(spec, "sql", "declaration", required=False) if "sql" in spec else None
    if sql is not None:
        from .sandbox import check_source_sql  # the sandbox module reports with this module's SourceError

        check_source_sql(sql, "spark" if engine == "spark" else "sqlalchemy")
    files = _parse_files(spec.get("files"))
    if files and engine == "sqlalchemy" and url is not None and not url.startswith("duckdb"):
        raise SourceError("The metric source's \"files\" are read by DuckDB and Spark only; this URL is "
                          f"{sa.engine.make_url(url).get_backend_name()}.")
    late_rounds = spec.get("late_rounds", 1)
    if isinstance(late_rounds, bool) or not isinstance(late_rounds, int) or not 0 <= late_rounds <= MAX_LATE_ROUNDS:
        raise SourceError(f"The metric source's \"late_rounds\" is {late_rounds!r}; it must be a whole number "
                          f"from 0 to {MAX_LATE_ROUNDS}.")
    return MetricSource(engine, url, url_env, password_env, files, mapping, sql, late_rounds)
