"""Every SQL statement of the service, API tokens included, and the :class:`UnitOfWork` that the use
cases open their transactions with.

The controller (``service.controller``) owns the transactions: each use case is given a
:class:`UnitOfWork`, opens its transactions with ``uow.read()`` / ``uow.write()`` and calls the
functions here, which each run one or a few statements in the transaction they are given. Nothing
here imports Flask or knows about HTTP; failures the controller must turn into an answer are the
exceptions defined below.

Statistics (see ``service.controller.rounds`` for the timeline): ``round_statistics`` holds one row
per (round, segment, arm, metric); ``pooled_arrays`` the running totals of every applied round, one
row per (segment, metric) with the K arms' totals as arrays; ``late_statistics`` the cells of observations accepted for a round
already applied, until the next update folds them into the totals. An unsegmented experiment has
segment 0 only; a segmented experiment's totals over its segments are sums of its rows, read as such
(nothing is stored twice). The functions take the number of segments S and give (S, M, K)
:class:`Statistics`. Pooled statistics are running totals, so a close costs the same in round 1,000 as
in round 1. Float sums are accumulated update by update, so they can differ in the last bits from one
aggregate over all rows.

The ingestion statements are plain SQL on the DBAPI cursor (:func:`insert_new`, :func:`add_rows`,
:func:`_fetch_array`): on that path they are several times faster than SQLAlchemy's per-row
parameter processing and row objects.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.orm import Session

from pasto.estimators import Statistics

from .db import Database
from .responses import RoundSummary
from .models import (ARRAY_DTYPE, ROLES, Arm, ArmRoundCount, AuthFailure, Base, DeletedExperiment, DetectorSnapshot,
                     Experiment, ExperimentEvent,
                     LateStatistic, ObservationId, Round, RoundCount, RoundStatistic, RoundUnit,
                     SchedulerHeartbeat, SegmentValueUnit, SourceCell, SourceStatus, SourceUnits, StatisticsBatch,
                     Token, utcnow)

if TYPE_CHECKING:
    from .cache import ExperimentCache

_INSERT_CHUNK = 500  # rows per multi-row INSERT (SQLite allows 32,766 parameters, PostgreSQL 65,535)
_experiments = Experiment.__table__
_rounds = Round.__table__


class KeysExist(Exception):
    """A plain insert (``insert_new(..., expect_new=True)``) met a key that exists. The transaction
    cannot go on (PostgreSQL has aborted it): roll it back and run it again without ``expect_new``.
    Any other integrity error then surfaces from the conflict-checking insert."""


class ExperimentExists(Exception):
    """An experiment with this name exists already (found, or the unique constraint refused it)."""


# ------------------------------------------------------------------------------ bulk statements
def insert_new(connection: sa.Connection, table: sa.Table, columns: tuple[str, ...], rows: list[tuple],
               returning: tuple[str, ...], expect_new: bool = False) -> list[tuple]:
    """``INSERT ... ON CONFLICT (primary key) DO NOTHING RETURNING ...`` of many rows; returns the
    ``returning`` columns of the rows that were new.

    Written as plain SQL: on the ingestion path this is several times faster than going through
    SQLAlchemy's per-row parameter processing. Rows are inserted in the order given (callers sort
    them so that concurrent writers lock rows in one order). Values must be plain
    ``int``/``str``/``float``.

    ``expect_new``: a plain ``INSERT`` instead, for keys that are almost always new (observation
    ids, where an existing one means a client's retry). On PostgreSQL it costs about 2 ms less per
    1,000 rows than the conflict-checking insert. If any key exists, or a concurrent transaction
    commits one first, it raises :class:`KeysExist`: the caller rolls its transaction back and runs
    it again without ``expect_new``. (Not a savepoint: a subtransaction per request would double
    the transaction ids used and is a known scaling hazard on PostgreSQL replicas.)
    """
    if expect_new:
        try:
            _insert_rows(connection, table, columns, rows, "")
        except connection.dialect.loaded_dbapi.IntegrityError as error:  # raw cursor: the driver's own
            raise KeysExist(f"Some keys of the {len(rows)} rows already exist in {table.name}.") from error
        positions = [columns.index(column) for column in returning]
        return [tuple(row[position] for position in positions) for row in rows]
    key = ", ".join(_quote(connection, column.name) for column in table.primary_key.columns)
    conflict = (f"ON CONFLICT ({key}) DO NOTHING RETURNING "
                f"{', '.join(_quote(connection, c) for c in returning)}")
    return [tuple(row) for row in _insert_rows(connection, table, columns, rows, conflict)]


def add_rows(connection: sa.Connection, table: sa.Table, keys: tuple[str, ...], values: tuple[str, ...],
             rows: list[tuple]) -> None:
    """Upsert that adds: ``INSERT ... ON CONFLICT (keys) DO UPDATE SET v = v + excluded.v`` for
    each of ``values``. ``rows`` hold the ``keys`` then the ``values`` columns, at most one row per
    key, in the order the rows should be locked."""
    name = connection.dialect.identifier_preparer.format_table(table)
    updates = ", ".join(
        f"{_quote(connection, v)} = {name}.{_quote(connection, v)} + excluded.{_quote(connection, v)}"
        for v in values)
    conflict = f"ON CONFLICT ({', '.join(_quote(connection, k) for k in keys)}) DO UPDATE SET {updates}"
    _insert_rows(connection, table, keys + values, rows, conflict)


def _quote(connection: sa.Connection, name: str) -> str:
    return connection.dialect.identifier_preparer.quote(name)


def _insert_rows(connection: sa.Connection, table: sa.Table, columns: tuple[str, ...], rows: list[tuple],
                 conflict: str) -> list:
    """``INSERT INTO table (columns) <rows> <conflict>``; the rows RETURNING gives, if any.

    PostgreSQL: one statement over ``unnest`` of one typed array per column (a handful of
    parameters, so psycopg neither re-parses a huge statement nor sends a row at a time;
    ``unnest`` keeps the order of the rows), each array sent as the text of an array literal
    (:func:`_array_literal`). SQLite: multi-row VALUES in chunks.
    """
    if not rows:
        return []
    dialect = connection.dialect
    head = f"INSERT INTO {dialect.identifier_preparer.format_table(table)} " \
           f"({', '.join(_quote(connection, c) for c in columns)}) "
    if dialect.name == "postgresql":
        types = [_array_element_type(table.c[c].type, dialect) for c in columns]
        arrays = ", ".join(f"%s::{column_type}[]" for column_type in types)
        sql = f"{head}SELECT * FROM unnest({arrays}) {conflict}"
        return _execute_raw(connection, sql, tuple(_array_literal(column) for column in zip(*rows)))
    row_sql = "(" + ", ".join([_placeholder(connection)] * len(columns)) + ")"
    returned: list = []
    for start in range(0, len(rows), _INSERT_CHUNK):
        chunk = rows[start:start + _INSERT_CHUNK]
        sql = f"{head}VALUES {', '.join([row_sql] * len(chunk))} {conflict}"
        returned.extend(_execute_raw(connection, sql, tuple(value for row in chunk for value in row)))
    return returned


def _placeholder(connection: sa.Connection | sa.Engine) -> str:
    return "%s" if connection.dialect.paramstyle in ("format", "pyformat") else "?"


def _array_element_type(column_type: sa.types.TypeEngine, dialect: sa.Dialect) -> str:
    """The SQL name of ``column_type`` for a ``::<type>[]`` cast: without a ``COLLATE`` clause, which is
    not part of a type name (the column's collation applies on insert)."""
    column_type = column_type.dialect_impl(dialect)
    if getattr(column_type, "collation", None) is not None:
        column_type = column_type.copy()
        column_type.collation = None
    return column_type.compile(dialect=dialect)


def _array_literal(values: tuple) -> str:
    """PostgreSQL's text form of a one-dimensional array of ``values`` (all ``int``, all ``float`` or
    all ``str``, no NULL), for a ``%s::<type>[]`` parameter.

    psycopg's list dumpers encode one element at a time in Python; joining the elements' text is one
    C-level pass (about 1 ms less per 1,000-row ingestion statement, several per batch). ``repr``
    of a float is the shortest text that reads back as the same double, which PostgreSQL's parser
    does exactly. Strings are always double-quoted; quotes and backslashes in them are escaped.
    """
    if isinstance(values[0], str):
        every_character = "".join(values)
        if '"' in every_character or "\\" in every_character:
            values = tuple(value.replace("\\", "\\\\").replace('"', '\\"') for value in values)
        return '{"' + '","'.join(values) + '"}'
    return "{" + ",".join(map(repr, values)) + "}"


def _execute_raw(connection: sa.Connection, sql: str, parameters: tuple) -> list[tuple]:
    """Run ``sql`` on the DBAPI cursor of ``connection``'s current transaction; the rows it returns
    as plain tuples (no SQLAlchemy row objects: thousands per ingestion batch)."""
    if not connection.in_transaction():  # a raw cursor would not begin one (BEGIN IMMEDIATE on SQLite)
        raise RuntimeError("Raw statements must run inside the caller's transaction.")
    cursor = connection.connection.cursor()
    try:
        cursor.execute(sql, parameters)
        return cursor.fetchall() if cursor.description is not None else []
    finally:
        cursor.close()


# ------------------------------------------------------------------------------ experiments
def create_experiment(session: Session, *, name: str, config: dict[str, Any], seed: int, state: dict[str, Any],
                      arms: Sequence[tuple[str, dict[str, Any]]], probabilities: list[float], now: datetime,
                      round_seconds: float, segment_state: dict[str, Any] | None = None,
                      segment_probabilities: list[Any] | None = None) -> None:
    """Insert an experiment, its arms and its round 0 (segmented experiments: with their segmented
    state and round 0's per-segment propensities). :class:`ExperimentExists` if the name is taken
    (the caller's transaction must then be rolled back: a concurrent creation lost to the unique
    constraint)."""
    try:
        exists = session.execute(sa.select(Experiment.id).where(Experiment.name == name)).first()
        if exists is not None:
            raise ExperimentExists(name)
        experiment = Experiment(
            id=_next_sqlite_experiment_id(session), name=name, config=config, status="running", seed=seed,
            round_index=0, applied_rounds=0, state=state, segment_state=segment_state, version=1, created_at=now,
            updated_at=now,
        )
        session.add(experiment)
        session.flush()
        session.execute(sa.insert(Arm), [
            {"experiment_id": experiment.id, "position": position, "name": arm_name, "params": params}
            for position, (arm_name, params) in enumerate(arms)
        ])
        session.add(Round(experiment_id=experiment.id, index=0, started_at=now,
                          ends_at=now + timedelta(seconds=round_seconds), probabilities=probabilities,
                          segment_probabilities=segment_probabilities))
        session.flush()
        add_event(session, experiment.id, "created", 0, now)
    except sa.exc.IntegrityError:
        # Two concurrent creations with the same name: the unique constraint decides.
        raise ExperimentExists(name) from None


def _next_sqlite_experiment_id(session: Session) -> int | None:
    """On SQLite, an id above every experiment's, deleted ones included (None: the database's own).

    SQLite gives a table without AUTOINCREMENT the largest id present plus one, so it would reuse the
    id of the newest experiment once that is deleted, and a worker still holding the deleted
    experiment's cached snapshot would ingest into the new one. Writes on SQLite are serialised
    (``BEGIN IMMEDIATE``), so two creations cannot pick the same id. PostgreSQL's sequence never
    goes back."""
    if session.get_bind().dialect.name != "sqlite":
        return None
    highest = session.execute(sa.select(sa.func.max(sa.func.coalesce(
        sa.select(sa.func.max(Experiment.id)).scalar_subquery(), 0), sa.func.coalesce(
        sa.select(sa.func.max(DeletedExperiment.id)).scalar_subquery(), 0)))).scalar_one()
    return int(highest) + 1


def experiment_names(session: Session, archived: bool = False) -> list[str]:
    """Names of the experiments not archived (``archived``: of the archived ones), oldest first."""
    archived_at = Experiment.archived_at.is_not(None) if archived else Experiment.archived_at.is_(None)
    return list(session.execute(sa.select(Experiment.name).where(archived_at).order_by(Experiment.id)).scalars())


def archive_experiment(session: Session, experiment: sa.Row, now: datetime) -> None:
    """Archive a locked experiment: stopped (it serves its deployed mixture and closes no more
    rounds) and marked archived; a new version, so every worker's cached snapshot is refreshed."""
    session.execute(sa.update(_experiments).where(_experiments.c.id == experiment.id)
                    .values(status="stopped", archived_at=now, version=_experiments.c.version + 1, updated_at=now))


def _tables_of_an_experiment() -> list[sa.Table]:
    """Every table with rows of one experiment (an ``experiment_id`` column), those that refer to
    others first: whatever tables are added to ``service.models``, a delete reaches them all."""
    return [table for table in reversed(Base.metadata.sorted_tables)
            if "experiment_id" in table.c and table is not _experiments]


def delete_experiment(session: Session, experiment: sa.Row, now: datetime) -> dict[str, int]:
    """Delete a locked experiment and every row of it, and record its id in ``deleted_experiments``
    (never given out again); the number of rows deleted per table.

    Each table is deleted from explicitly: ``observation_ids`` and ``round_units`` have no foreign
    key to ``experiments`` (migration 0003), and SQLite only cascades with ``PRAGMA foreign_keys``.
    """
    deleted = {}
    for table in _tables_of_an_experiment():
        deleted[table.name] = session.execute(
            sa.delete(table).where(table.c.experiment_id == experiment.id)).rowcount
    deleted["experiments"] = session.execute(sa.delete(_experiments).where(_experiments.c.id == experiment.id)).rowcount
    session.execute(sa.insert(DeletedExperiment.__table__).values(id=experiment.id, name=experiment.name,
                                                                  deleted_at=now))
    return deleted


def experiment_row_counts(session: Session, experiment_id: int) -> dict[str, int]:
    """Rows of experiment ``experiment_id`` per table (its ``experiments`` row included)."""
    counts = {table.name: session.execute(sa.select(sa.func.count()).select_from(table)
                                          .where(table.c.experiment_id == experiment_id)).scalar_one()
              for table in _tables_of_an_experiment()}
    counts["experiments"] = session.execute(sa.select(sa.func.count()).select_from(_experiments)
                                            .where(_experiments.c.id == experiment_id)).scalar_one()
    return counts


def experiment_version(database: Database, name: str) -> tuple[int, int] | None:
    """``(id, version)`` of experiment ``name``, or None. The hottest query of the service: plain DBAPI,
    no ORM or SQL compilation on the way."""
    probe = database.status.admit()  # as Database.read() does: no wait for a database known to be away
    try:
        connection = database.engine.raw_connection()
        try:
            cursor = connection.cursor()
            try:
                cursor.execute(f"SELECT id, version FROM experiments WHERE name = {_placeholder(database.engine)}",
                               (name,))
                row = cursor.fetchone()
            finally:
                cursor.close()
            connection.rollback()
        except BaseException:
            # A connection that failed (the server went away mid-query) is dropped, not returned to the
            # pool: the pool's reset of it would fail again and log a traceback of its own.
            connection.invalidate()
            raise
        finally:
            connection.close()
    finally:
        if probe:
            database.status.probe_done()
    return None if row is None else (int(row[0]), int(row[1]))


def load_experiment(session: Session, name: str) -> tuple[Experiment, Round] | None:
    """Experiment ``name`` and its current round (ORM objects), or None."""
    experiment = session.execute(sa.select(Experiment).where(Experiment.name == name)).scalar_one_or_none()
    if experiment is None:
        return None
    current = session.execute(
        sa.select(Round).where(Round.experiment_id == experiment.id, Round.index == experiment.round_index)
    ).scalar_one()
    return experiment, current


def arms(session: Session, experiment_id: int) -> list[tuple[str, dict[str, Any]]]:
    """``(name, params)`` of every arm, in position order."""
    return [tuple(row) for row in session.execute(
        sa.select(Arm.name, Arm.params).where(Arm.experiment_id == experiment_id).order_by(Arm.position))]


def arm_names(session: Session, experiment_id: int) -> list[str]:
    return list(session.execute(
        sa.select(Arm.name).where(Arm.experiment_id == experiment_id).order_by(Arm.position)).scalars())


def round_probabilities(database: Database, experiment_id: int, round_index: int) -> list[float] | None:
    """The propensities served in a round (None: no such round)."""
    with database.read() as session:
        return session.execute(
            sa.select(Round.probabilities).where(Round.experiment_id == experiment_id, Round.index == round_index)
        ).scalar_one_or_none()


def round_probabilities_text(session: Session, experiment_id: int, round_indices: Sequence[int]) -> list[tuple[int, str]]:
    """``(index, propensities as JSON text)`` of the given rounds: the caller parses the K numbers
    itself (``numpy``), several times faster than a JSON column's decoding at K = 10,000."""
    rows: list[tuple[int, str]] = []
    indices = sorted(round_indices)
    for start in range(0, len(indices), 100):
        rows.extend(tuple(row) for row in session.connection().execute(
            sa.select(Round.index, sa.cast(Round.probabilities, sa.Text))
            .where(Round.experiment_id == experiment_id, Round.index.in_(indices[start:start + 100]))))
    return rows


def round_segment_probabilities(database: Database, experiment_id: int, round_index: int) -> list[Any] | None:
    """The per-segment propensities (S x K) served in a round of a segmented experiment (None: no such round)."""
    with database.read() as session:
        return session.execute(
            sa.select(Round.segment_probabilities)
            .where(Round.experiment_id == experiment_id, Round.index == round_index)
        ).scalar_one_or_none()


def lock_experiment(session: Session, experiment_id: int) -> sa.Row | None:
    """The experiment's row, locked exclusively until the transaction ends (None: no such experiment)."""
    return session.execute(
        sa.select(_experiments).where(_experiments.c.id == experiment_id).with_for_update()
    ).one_or_none()


def set_status(session: Session, experiment: sa.Row, status: str, now: datetime,
               current_round_ends_at: datetime | None = None) -> None:
    """Change a locked experiment's status (and the current round's planned end, when given)."""
    if current_round_ends_at is not None:
        session.execute(
            sa.update(Round)
            .where(Round.experiment_id == experiment.id, Round.index == experiment.round_index)
            .values(ends_at=current_round_ends_at)
        )
    session.execute(sa.update(_experiments).where(_experiments.c.id == experiment.id)
                    .values(status=status, version=_experiments.c.version + 1, updated_at=now))


# ------------------------------------------------------------------------------ ingestion
def lock_for_ingestion(session: Session, experiment_id: int) -> sa.Row | None:
    """``(status, applied_rounds, pruned_rounds)`` under a share lock on the experiment's row (None:
    deleted).

    Shares the row lock with other ingestion requests and excludes a concurrent round close, delete or
    retention's advance of ``pruned_rounds``, so "late" and "pruned" are decided against the rounds as
    they are when this transaction commits.
    """
    return session.connection().execute(
        sa.select(Experiment.status, Experiment.applied_rounds, Experiment.pruned_rounds)
        .where(Experiment.id == experiment_id)
        .with_for_update(read=True)
    ).one_or_none()


def insert_observation_ids(session: Session, experiment_id: int, rows: list[tuple[str, int, int]],
                           expect_new: bool) -> list[str]:
    """Insert ``(client_id, round_index, arm_index)`` rows, sorted by id (concurrent batches sharing ids
    then wait on each other in one order, never in a cycle); the ids that were new. With
    ``expect_new``, :class:`KeysExist` if one was not (see :func:`insert_new`)."""
    inserted = insert_new(
        session.connection(), ObservationId.__table__, ("experiment_id", "client_id", "round_index", "arm_index"),
        [(experiment_id, *row) for row in rows], returning=("client_id",), expect_new=expect_new,
    )
    return [client_id for (client_id,) in inserted]


def add_statistics(connection: sa.Connection, experiment_id: int, cells: list[tuple], applied_rounds: int) -> None:
    """Add ``cells`` (``(round_index, segment_index, arm_index, metric_index, count, sum,
    sum_of_squares)``, one per key, sorted by key; segment 0 for an unsegmented experiment) to the round
    statistics, and the cells of rounds already applied (late data) to ``late_statistics`` too, where
    the next round update finds them (:func:`update_statistics`).

    ``applied_rounds`` must have been read under the share lock on the experiment's row that this
    transaction holds (:func:`lock_for_ingestion`): a round update, which empties ``late_statistics``,
    waits for it.
    """
    add_rows(
        connection, RoundStatistic.__table__,
        ("experiment_id", "round_index", "segment_index", "arm_index", "metric_index"),
        ("count", "sum", "sum_of_squares"), [(experiment_id, *cell) for cell in cells],
    )
    late: dict[tuple[int, int, int], list] = {}
    for round_index, segment, arm, metric, count, total, total_of_squares in cells:
        if round_index < applied_rounds:
            sums = late.setdefault((segment, metric, arm), [0, 0.0, 0.0])
            sums[0] += count
            sums[1] += total
            sums[2] += total_of_squares
    if late:
        add_rows(
            connection, LateStatistic.__table__, ("experiment_id", "segment_index", "metric_index", "arm_index"),
            ("count", "sum", "sum_of_squares"),
            [(experiment_id, *key, *sums) for key, sums in sorted(late.items())],
        )


def add_units_and_counts(connection: sa.Connection, experiment_id: int, observations: Iterable[tuple[int, str, int]],
                         applied_rounds: int) -> Counter[int]:
    """Record the units and per-(round, arm) counts of new observations ``(round_index, unit, arm)``;
    returns the observations per arm."""
    counts: Counter[tuple[int, int]] = Counter()
    late: Counter[tuple[int, int]] = Counter()
    unit_arm: dict[tuple[int, str], int] = {}
    for round_index, unit, arm in observations:
        key = (round_index, arm)
        counts[key] += 1
        if round_index < applied_rounds:
            late[key] += 1
        unit_arm.setdefault((round_index, unit), arm)
    new_units = Counter(insert_new(
        connection, RoundUnit.__table__, ("experiment_id", "round_index", "unit", "arm_index"),
        [(experiment_id, round_index, unit, arm) for (round_index, unit), arm in sorted(unit_arm.items())],
        returning=("round_index", "arm_index"),
    ))
    add_arm_round_counts(connection, experiment_id, [
        (key[0], key[1], count, new_units.get(key, 0), late.get(key, 0)) for key, count in sorted(counts.items())])
    arm_counts: Counter[int] = Counter()
    for (_, arm), count in counts.items():
        arm_counts[arm] += count
    return arm_counts


def statistics_batch_hash(session: Session, experiment_id: int, batch_id: str) -> str | None:
    """The content hash of statistics batch ``batch_id`` if it was applied (and not pruned), else None."""
    table = StatisticsBatch.__table__
    return session.execute(
        sa.select(table.c.content_hash).where(table.c.experiment_id == experiment_id, table.c.batch_id == batch_id)
    ).scalar_one_or_none()


def insert_statistics_batch(database: Database, session: Session, experiment_id: int, batch_id: str,
                            content_hash: str, rounds: tuple[int, int], cells: int, now: datetime) -> bool:
    """Record statistics batch ``batch_id``; False, writing nothing, when the id exists already (a
    concurrent request with the same id committed first: PostgreSQL makes this insert wait for it)."""
    table = StatisticsBatch.__table__
    statement = database.insert(table).values(
        experiment_id=experiment_id, batch_id=batch_id, content_hash=content_hash, first_round=rounds[0],
        last_round=rounds[1], cells=cells, received_at=now,
    ).on_conflict_do_nothing(index_elements=[table.c.experiment_id, table.c.batch_id]).returning(table.c.batch_id)
    return session.execute(statement).first() is not None


def add_arm_round_counts(connection: sa.Connection, experiment_id: int, rows: list[tuple[int, int, int, int, int]]
                         ) -> None:
    """Add ``(round_index, arm_index, observations, units, late_observations)`` rows (one per key, sorted
    by key) to the per-round counts ``arm_round_counts``, and their sums over the arms to
    ``round_counts`` (one row per round), in the caller's transaction. Every writer of the counts comes
    here, so the two tables agree; the rows may be differences (a restated source round).

    Both upserts lock their rows in key order, ``arm_round_counts`` first, so concurrent writers wait
    for each other rather than deadlock."""
    add_rows(
        connection, ArmRoundCount.__table__, ("experiment_id", "round_index", "arm_index"),
        ("observations", "units", "late_observations"), [(experiment_id, *row) for row in rows],
    )
    totals: dict[int, list[int]] = {}
    for round_index, _, observations, units, late_observations in rows:
        sums = totals.setdefault(round_index, [0, 0, 0])
        sums[0] += observations
        sums[1] += units
        sums[2] += late_observations
    add_rows(
        connection, RoundCount.__table__, ("experiment_id", "round_index"),
        ("observations", "units", "late_observations"),
        [(experiment_id, round_index, *sums) for round_index, sums in sorted(totals.items())],
    )


# ------------------------------------------------------------------------------ retention
#: The per-round tables retention empties for old rounds, each with its round column.
PRUNED_TABLES = ((ObservationId.__table__, "round_index"), (RoundUnit.__table__, "round_index"),
                 (StatisticsBatch.__table__, "last_round"))


def prunable_rounds(session: Session, experiment_id: int, applied_before: datetime) -> int:
    """The number of leading rounds of the experiment whose update ran at or before ``applied_before``
    (rounds are applied in order, so they are a prefix): the ``pruned_rounds`` retention may set."""
    latest = session.execute(
        sa.select(sa.func.max(_rounds.c.index))
        .where(_rounds.c.experiment_id == experiment_id, _rounds.c.applied_at.is_not(None),
               _rounds.c.applied_at <= applied_before)
    ).scalar_one_or_none()
    return 0 if latest is None else latest + 1


def experiments_to_prune(database: Database) -> list[tuple[int, int]]:
    """``(id, pruned_rounds)`` of every experiment, for retention."""
    with database.read() as session:
        return [tuple(row) for row in session.execute(
            sa.select(_experiments.c.id, _experiments.c.pruned_rounds).order_by(_experiments.c.id))]


def advance_pruned_rounds(session: Session, experiment_id: int, pruned_rounds: int) -> bool:
    """Raise the experiment's ``pruned_rounds`` to ``pruned_rounds`` (never lower it); True if it rose.

    The update takes the row's exclusive lock, so it waits for ingestion transactions in flight (they
    hold it shared, :func:`lock_for_ingestion`) and every later one sees the new value: no id of a
    round below it is deleted while an ingestion that could still accept data for that round runs.
    Does not change ``version``: assignment does not depend on it."""
    return session.execute(
        sa.update(_experiments)
        .where(_experiments.c.id == experiment_id, _experiments.c.pruned_rounds < pruned_rounds)
        .values(pruned_rounds=pruned_rounds)
    ).rowcount == 1


def delete_pruned_rows(session: Session, table: sa.Table, round_column: str, experiment_id: int,
                       pruned_rounds: int, limit: int) -> int:
    """Delete at most ``limit`` rows of ``table`` for rounds below ``pruned_rounds``; the number deleted.

    A bounded chunk per transaction (found through the index by round), so retention never holds long
    locks or writes one huge transaction."""
    key = list(table.primary_key.columns)
    chunk = (sa.select(*key)
             .where(table.c.experiment_id == experiment_id, table.c[round_column] < pruned_rounds)
             .limit(limit))
    return session.execute(sa.delete(table).where(sa.tuple_(*key).in_(chunk))).rowcount


# ------------------------------------------------------------------------------ rounds
def due_experiment_ids(database: Database, now: datetime) -> list[int]:
    """Running experiments whose current round has ended or that have an update pending."""
    with database.read() as session:
        return list(session.execute(
            sa.select(_experiments.c.id)
            .join(_rounds, sa.and_(_rounds.c.experiment_id == _experiments.c.id,
                                   _rounds.c.index == _experiments.c.round_index))
            .where(_experiments.c.status == "running")
            .where(sa.or_(_rounds.c.ends_at <= now, _experiments.c.applied_rounds < _experiments.c.round_index))
            .order_by(_experiments.c.id)
        ).scalars())


def due_experiments(database: Database, now: datetime) -> list[tuple[int, bool]]:
    """Like :func:`due_experiment_ids`, each with whether it declares a metric source."""
    with database.read() as session:
        return [(row.id, (row.config or {}).get("source") is not None) for row in session.execute(
            sa.select(_experiments.c.id, _experiments.c.config)
            .join(_rounds, sa.and_(_rounds.c.experiment_id == _experiments.c.id,
                                   _rounds.c.index == _experiments.c.round_index))
            .where(_experiments.c.status == "running")
            .where(sa.or_(_rounds.c.ends_at <= now, _experiments.c.applied_rounds < _experiments.c.round_index))
            .order_by(_experiments.c.id))]


def rounds_from(session: Session, experiment_id: int, first_index: int) -> dict[int, Round]:
    """Rounds ``first_index`` and later (ORM objects: changes to them are written at commit)."""
    return {row.index: row for row in session.execute(
        sa.select(Round).where(Round.experiment_id == experiment_id, Round.index >= first_index)).scalars()}


def record_update(round_row: Round, now: datetime, deployed: list[float]) -> None:
    """Mark a round applied (written at commit)."""
    round_row.applied_at = now
    round_row.deployed = deployed


def advance_experiment(session: Session, experiment: sa.Row, *, round_index: int, applied_rounds: int,
                       state: dict[str, Any], now: datetime) -> bool:
    """Compare-and-set on the experiment row (``WHERE round_index = :i AND applied_rounds = :a``): False,
    changing nothing, when another process advanced it first."""
    return session.execute(
        sa.update(_experiments)
        .where(_experiments.c.id == experiment.id,
               _experiments.c.round_index == experiment.round_index,
               _experiments.c.applied_rounds == experiment.applied_rounds)
        .values(round_index=round_index, applied_rounds=applied_rounds, state=state,
                version=_experiments.c.version + 1, updated_at=now)
    ).rowcount == 1


def read_detector_snapshots(session: Session, experiment_id: int, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The experiment's stored change-detector snapshots among ``names`` (``change_origin``,
    ``window_origins``), as ``ControllerState.to_dict`` wrote them; a name without a row is absent."""
    names = list(names)
    if not names:
        return {}
    d = DetectorSnapshot.__table__.c
    return {name: document for name, document in session.execute(
        sa.select(d.name, d.document).where(d.experiment_id == experiment_id, d.name.in_(names)))}


def write_detector_snapshots(session: Session, experiment_id: int, documents: dict[str, dict[str, Any] | None]) -> None:
    """Replace the named snapshots (a None document deletes the row)."""
    table = DetectorSnapshot.__table__
    for name, document in documents.items():
        session.execute(sa.delete(table).where(table.c.experiment_id == experiment_id, table.c.name == name))
        if document is not None:
            session.execute(sa.insert(table).values(experiment_id=experiment_id, name=name, document=document))


def close_and_start_round(session: Session, current: Round, *, now: datetime, next_index: int,
                          round_seconds: float, probabilities: list[float],
                          segment_probabilities: list[Any] | None = None,
                          scheduled_at: datetime | None = None) -> None:
    """Close ``current`` now (a round closed early by hand was served until now, not its planned end)
    and start round ``next_index`` (segmented experiments: with the per-segment propensities it serves).

    The next round ends ``round_seconds`` after ``scheduled_at`` (default ``now``): the moment the
    close was due, so a close that commits later than it began keeps the schedule."""
    current.closed_at = now
    current.ends_at = min(current.ends_at, now)
    session.add(Round(experiment_id=current.experiment_id, index=next_index, started_at=now,
                      ends_at=(scheduled_at or now) + timedelta(seconds=round_seconds), probabilities=probabilities,
                      segment_probabilities=segment_probabilities))


def store_summaries(database: Database, experiment_id: int, summaries: list[tuple[int, RoundSummary]]) -> None:
    """Store ``(round_index, summary)`` of rounds that have none yet, in one transaction, and clear their
    summary inputs (a round whose summary another process stored first keeps that one)."""
    r = _rounds.c
    with database.write() as session:
        for round_index, summary in summaries:
            # One statement: on SQLite an UPDATE rewrites the whole row (its K propensities and deployed
            # mixture included), so the summary and the cleared input are written together.
            session.execute(
                sa.update(_rounds)
                .where(r.experiment_id == experiment_id, r.index == round_index,
                       sa.or_(r.summary.is_(None), r.summary_input.is_not(None)))
                .values(summary=sa.func.coalesce(r.summary, sa.bindparam("summary", summary.to_json(),
                                                                          type_=r.summary.type)),
                        summary_input=None)
            )


def record_summary_input(round_row: Round, summary_input: dict[str, Any]) -> None:
    """Keep what the round's summary is computed from, written with its update (at commit)."""
    round_row.summary_input = summary_input


def unsummarized_input(session: Session, experiment_id: int, round_index: int) -> dict[str, Any] | None:
    """The summary input of round ``round_index`` when its summary is not stored yet (None: stored, or no
    input). One indexed row; the input itself is read only when the summary is missing."""
    r = _rounds.c
    where = (r.experiment_id == experiment_id, r.index == round_index, r.summary.is_(None), r.summary_input.is_not(None))
    if session.execute(sa.select(sa.literal(1)).where(*where)).first() is None:
        return None
    return session.execute(sa.select(Round.summary_input).where(*where)).scalar_one_or_none()


def replace_summary_input(session: Session, experiment_id: int, round_index: int, summary_input: dict[str, Any]) -> None:
    """Replace round ``round_index``'s summary input, unless its summary was stored meanwhile."""
    session.execute(sa.update(Round)
                    .where(Round.experiment_id == experiment_id, Round.index == round_index, Round.summary.is_(None),
                           Round.summary_input.is_not(None))
                    .values(summary_input=summary_input))


def experiment_state(session: Session, experiment_id: int) -> sa.Row | None:
    """``(applied_rounds, state, segment_state)`` of the experiment, without a lock (None: no such
    experiment)."""
    e = _experiments.c
    return session.execute(sa.select(e.applied_rounds, e.state, e.segment_state).where(e.id == experiment_id)
                           ).one_or_none()


def round_propensities(session: Session, experiment_id: int, round_index: int) -> list[float] | None:
    """The propensities served in round ``round_index`` (None: no such round), in ``session``."""
    return session.execute(
        sa.select(Round.probabilities).where(Round.experiment_id == experiment_id, Round.index == round_index)
    ).scalar_one_or_none()


def pooled_totals(session: Session, experiment_id: int, shape: tuple[int, int, int]) -> Statistics:
    """The running totals (S, M, K) as they are stored (the pooled statistics of the applied rounds,
    without the late cells since the last update)."""
    return _statistics(_read_pooled_arrays(session, experiment_id, shape))


def pending_summaries(database: Database, applied_before: datetime, limit: int = 20) -> list[tuple[int, int, dict]]:
    """``(experiment_id, round_index, summary_input)`` of applied rounds (before ``applied_before``)
    whose summary was never stored: the close committed, the summary's write did not happen."""
    with database.read() as session:
        return [(row.experiment_id, row.index, row.summary_input) for row in session.execute(
            sa.select(_rounds.c.experiment_id, _rounds.c.index, _rounds.c.summary_input)
            .where(_rounds.c.summary.is_(None), _rounds.c.summary_input.is_not(None),
                   _rounds.c.applied_at <= applied_before)
            .order_by(_rounds.c.experiment_id, _rounds.c.index)
            .limit(limit))]


def update_statistics(database: Database, session: Session, experiment_id: int, round_index: int, n_segments: int,
                      n_metrics: int, n_arms: int) -> tuple[Statistics, Statistics]:
    """Round ``round_index``'s statistics and the pooled statistics of rounds <= ``round_index``, each
    (S, M, K) with S = ``n_segments`` (1 for an unsegmented experiment), for its update: reads the
    round's rows, the late cells and the running totals, adds the round and the late cells into the
    totals in numpy, writes the totals back and empties ``late_statistics``. Nothing here grows with
    the number of rounds.

    The totals are one row per (segment, metric) holding the K arms' arrays (``pooled_arrays``,
    migration 0018): S x M rows read and written instead of an upsert into S x M x K rows. The sums
    are the ones the per-arm upsert made, bit for bit: per cell, the round's and the late cell's
    values added first (the upsert's ``SUM`` over those two), then added to the total.

    Must run in the close transaction, after the experiment row was locked exclusively, for the
    rounds in order: ingestion holds that lock shared (:func:`lock_for_ingestion`), so no observation
    lands between reading the late cells and deleting them, and the round's rows are final (later
    observations for it are late, and go to ``late_statistics`` too).
    """
    shape = (n_segments, n_metrics, n_arms)
    connection = session.connection()
    this_round, present = _read_cells(connection, "round_statistics", "AND round_index = {p}",
                                      (experiment_id, round_index), shape)
    late, late_present = _read_cells(connection, "late_statistics", "", (experiment_id,), shape)
    additions = this_round.copy()
    if late_present.any():
        additions[:, late_present] += late[:, late_present]
        present |= late_present
        session.execute(sa.delete(LateStatistic.__table__).where(LateStatistic.__table__.c.experiment_id == experiment_id))
    pooled = _read_pooled_arrays(session, experiment_id, shape)
    pooled += additions
    _write_pooled_arrays(session, experiment_id, pooled, [tuple(map(int, key)) for key in np.argwhere(present.any(axis=2))])
    return _statistics(this_round), _statistics(pooled)


def _read_cells(connection: sa.Connection, table: str, where: str, parameters: tuple, shape: tuple[int, int, int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The cells of ``table`` (``round_statistics`` or ``late_statistics``) of experiment
    ``parameters[0]`` (``where``: more conditions, ``{p}`` marking the rest of ``parameters``), at
    most one row per (segment, metric, arm): an array (3, S, M, K) of count, sum and sum of squares
    (zeros where there is no row) and the mask (S, M, K) of the cells that have a row.

    At K = 100,000 a round has 500,000 rows, whose Python objects cost more than the query: on
    PostgreSQL the server packs each (segment, metric)'s column values into one bytea
    (``string_agg`` of ``int4send`` / ``int8send`` / ``float8send``, the values' binary send form,
    big-endian: exact), read in the binary result format, so S x M rows come back; on SQLite each
    row is (one integer cell index, count, sum, sum of squares) flattened into numpy in one pass."""
    n_segments, n_metrics, n_arms = shape
    values = np.zeros((3, n_segments * n_metrics * n_arms))
    present = np.zeros(n_segments * n_metrics * n_arms, dtype=bool)
    sql = _cells_sql(connection, table, where, shape)
    cursor = connection.connection.cursor()
    try:
        if connection.dialect.name == "postgresql":
            cursor.execute(sql, parameters, binary=True)
            for segment, metric, arms, count, total, squares in cursor.fetchall():
                cells = (segment * n_metrics + metric) * n_arms + np.frombuffer(arms, dtype=">i4").astype(np.int64)
                values[0, cells] = np.frombuffer(count, dtype=">i8")
                values[1, cells] = np.frombuffer(total, dtype=">f8")
                values[2, cells] = np.frombuffer(squares, dtype=">f8")
                present[cells] = True
        else:
            cursor.execute(sql, parameters)
            rows = cursor.fetchall()
            data = np.fromiter(itertools.chain.from_iterable(rows), np.float64, count=len(rows) * 4).reshape(-1, 4)
            cells = data[:, 0].astype(np.int64)
            values[:, cells] = data[:, 1:].T
            present[cells] = True
    finally:
        cursor.close()
    return values.reshape(3, *shape), present.reshape(shape)


def pooled_statistics(session: Session, experiment_id: int, last_round: int, n_segments: int, n_metrics: int,
                      n_arms: int) -> Statistics:
    """Statistics summed over rounds <= ``last_round`` without writing (for reports), (S, M, K): the
    running totals, the late cells, and the rows of the rounds from the first one not applied up to
    ``last_round``. In one read transaction (one snapshot: ``applied_rounds`` and the rows it
    selects come from the same state of the database), so a close committing meanwhile cannot make a
    row count twice or not at all."""
    shape = (n_segments, n_metrics, n_arms)
    connection = session.connection()
    cells = _fetch_array(
        connection,
        "SELECT segment_index, metric_index, arm_index, count, sum, sum_of_squares FROM late_statistics "
        "WHERE experiment_id = {p} "
        "UNION ALL SELECT segment_index, metric_index, arm_index, count, sum, sum_of_squares FROM round_statistics "
        "WHERE experiment_id = {p} AND round_index <= {p} "
        "AND round_index >= (SELECT applied_rounds FROM experiments WHERE id = {p})",
        (experiment_id, experiment_id, last_round, experiment_id), 6, np.float64)
    totals = _read_pooled_arrays(session, experiment_id, shape)
    if len(cells):
        index = _cell_index(cells)
        for value in range(3):
            np.add.at(totals[value], index, cells[:, 3 + value])
    return _statistics(totals)


def _cells_sql(connection: sa.Connection, table: str, where: str, shape: tuple[int, int, int]) -> str:
    """The statement :func:`_read_cells` runs on ``connection``'s backend."""
    p = _placeholder(connection)
    where = f"WHERE experiment_id = {p} {where.format(p=p)}"
    if connection.dialect.name == "postgresql":
        return ("SELECT segment_index, metric_index, string_agg(int4send(arm_index), ''::bytea), "
                "string_agg(int8send(count), ''::bytea), string_agg(float8send(sum), ''::bytea), "
                f"string_agg(float8send(sum_of_squares), ''::bytea) FROM {table} {where} "
                "GROUP BY segment_index, metric_index")
    _, n_metrics, n_arms = shape
    return (f"SELECT (segment_index * {int(n_metrics)} + metric_index) * {int(n_arms)} + arm_index, "
            f"count, sum, sum_of_squares FROM {table} {where}")


def _cell_index(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (segment, metric, arm) index arrays of rows ``(segment_index, metric_index, arm_index, ...)``."""
    return tuple(rows[:, column].astype(np.int64) for column in range(3))


def _statistics(arrays: np.ndarray) -> Statistics:
    return Statistics(counts=arrays[0], sums=arrays[1], sums_of_squares=arrays[2])


def _read_pooled_arrays(session: Session, experiment_id: int, shape: tuple[int, int, int]) -> np.ndarray:
    """The running totals of experiment ``experiment_id`` as an array (3, S, M, K): count, sum, sum of
    squares (zeros for a (segment, metric) without a row). Raw DBAPI: the arrays are bytes, read as
    they are (on PostgreSQL in the binary result format, no hex text)."""
    connection = session.connection()
    totals = np.zeros((3, *shape))
    cursor = connection.connection.cursor()
    try:
        sql = (f"SELECT segment_index, metric_index, count, sum, sum_of_squares FROM pooled_arrays "
               f"WHERE experiment_id = {_placeholder(connection)}")
        if connection.dialect.name == "postgresql":
            cursor.execute(sql, (experiment_id,), binary=True)
        else:
            cursor.execute(sql, (experiment_id,))
        rows = cursor.fetchall()
    finally:
        cursor.close()
    for segment, metric, *values in rows:
        for value, data in enumerate(values):
            array = np.frombuffer(data, dtype=ARRAY_DTYPE)
            if array.shape != shape[2:]:
                raise ValueError(f"The pooled statistics of experiment {experiment_id} (segment {segment}, metric "
                                 f"{metric}) hold {array.size} arms, not {shape[2]}.")
            totals[value, segment, metric] = array
    return totals


def _write_pooled_arrays(session: Session, experiment_id: int, totals: np.ndarray,
                         keys: Sequence[tuple[int, int]]) -> None:
    """Store the running totals ``totals`` (3, S, M, K) of the (segment, metric) pairs ``keys`` (an
    upsert of one row per pair, in the order given)."""
    if not keys:
        return
    connection = session.connection()
    # PostgreSQL: the arrays go as binary parameters (%b), not as hex text twice their size.
    blob = "%b" if connection.dialect.name == "postgresql" else "?"
    p = _placeholder(connection)
    sql = (f"INSERT INTO pooled_arrays (experiment_id, segment_index, metric_index, count, sum, sum_of_squares) "
           f"VALUES ({p}, {p}, {p}, {blob}, {blob}, {blob}) ON CONFLICT (experiment_id, segment_index, metric_index) "
           "DO UPDATE SET count = excluded.count, sum = excluded.sum, sum_of_squares = excluded.sum_of_squares")
    as_bytes = totals.astype(ARRAY_DTYPE, copy=False)
    cursor = connection.connection.cursor()
    try:
        cursor.executemany(sql, [(experiment_id, segment, metric, *(as_bytes[value, segment, metric].tobytes()
                                                                    for value in range(3)))
                                 for segment, metric in keys])
    finally:
        cursor.close()


def segment_round_traffic(session: Session, experiment_id: int, since: int, last: int) -> list[tuple]:
    """``(round_index, segment_index, metric_index, count)`` of rounds ``since..last``: observations per
    round, segment and metric, summed over arms (the traffic shares of a segmented experiment's round
    history)."""
    table = RoundStatistic.__table__
    return [tuple(row) for row in session.execute(
        sa.select(table.c.round_index, table.c.segment_index, table.c.metric_index, sa.func.sum(table.c.count))
        .where(table.c.experiment_id == experiment_id, table.c.round_index >= since, table.c.round_index <= last)
        .group_by(table.c.round_index, table.c.segment_index, table.c.metric_index)
    )]


# ------------------------------------------------------------------------------ segments
def add_segment_value_units(connection: sa.Connection, experiment_id: int, rows: list[tuple[str, str]]) -> None:
    """Record ``(value, unit)`` pairs of an open segment set (sorted; existing pairs ignored)."""
    if rows:
        insert_new(connection, SegmentValueUnit.__table__, ("experiment_id", "value", "unit"),
                   [(experiment_id, value, unit) for value, unit in rows], returning=("value",))


def graduate_segment_values(session: Session, experiment_id: int, min_units: int, limit: int,
                            exclude: Sequence[str]) -> list[str]:
    """Up to ``limit`` values of an open set with at least ``min_units`` units (most units first, then by
    value), other than ``exclude``; their unit rows are deleted (they now have a mixture of their own).
    In the close transaction (the experiment row locked exclusively)."""
    if limit <= 0:
        return []
    table = SegmentValueUnit.__table__
    count = sa.func.count()
    values = [value for value in session.execute(
        sa.select(table.c.value).where(table.c.experiment_id == experiment_id)
        .group_by(table.c.value).having(count >= min_units).order_by(count.desc(), table.c.value)
    ).scalars() if value not in set(exclude)][:limit]
    if values:
        session.execute(sa.delete(table).where(table.c.experiment_id == experiment_id, table.c.value.in_(values)))
    return values


def segment_state(session: Session, experiment_id: int) -> dict[str, Any] | None:
    """A segmented experiment's stored ``SegmentedState.to_dict()`` (None: unsegmented, or no such
    experiment: deleted since the caller's snapshot of it)."""
    return session.execute(
        sa.select(Experiment.segment_state).where(Experiment.id == experiment_id)).scalar_one_or_none()


def write_segment_state(session: Session, experiment_id: int, segment_state: dict[str, Any]) -> None:
    """Store a segmented experiment's ``SegmentedState.to_dict()`` (in the close transaction, after the
    compare-and-set of :func:`advance_experiment` succeeded)."""
    session.execute(sa.update(_experiments).where(_experiments.c.id == experiment_id)
                    .values(segment_state=segment_state))


# ------------------------------------------------------------------------------ reports
def round_history(session: Session, experiment_id: int, since: int, last: int, *, segmented: bool
                  ) -> tuple[list[Round], np.ndarray, np.ndarray]:
    """Rounds ``since..last`` (ORM objects), their statistics rows ``(round_index, metric_index,
    arm_index, count, sum)`` as float64, shape (N, 5), summed over the segments of a ``segmented``
    experiment (one row per key), and their count rows ``(round_index, arm_index, observations, units,
    late_observations)`` as int64, shape (N', 5).

    The rows are read on the DBAPI cursor straight into numpy: a page of rounds at K = 100,000 has
    500,000 statistics rows per round, and SQLAlchemy row objects cost more than the query. An
    unsegmented experiment's rows (segment 0 only) are read as they are, without a GROUP BY."""
    round_rows = session.execute(
        sa.select(Round).where(Round.experiment_id == experiment_id, Round.index >= since, Round.index <= last)
        .order_by(Round.index)
    ).scalars().all()
    where = "WHERE experiment_id = {p} AND round_index >= {p} AND round_index <= {p}"
    if segmented:
        # Grouped in the key's order after the segment (round, arm, metric): SQLite's sorter then gets
        # rows already ordered by round, about 1.5x faster than (round, metric, arm) at S = 50.
        sql = (f"SELECT round_index, metric_index, arm_index, SUM(count), SUM(sum) FROM round_statistics {where} "
               "GROUP BY round_index, arm_index, metric_index")
    else:
        sql = f"SELECT round_index, metric_index, arm_index, count, sum FROM round_statistics {where}"
    statistics = _rows_array(session, sql, (experiment_id, since, last), np.float64)
    counts = _rows_array(
        session, "SELECT round_index, arm_index, observations, units, late_observations FROM arm_round_counts "
                 "WHERE experiment_id = {p} AND round_index >= {p} AND round_index <= {p}",
        (experiment_id, since, last), np.int64)
    return round_rows, statistics, counts


def _rows_array(session: Session, sql: str, parameters: tuple, dtype) -> np.ndarray:
    """The rows of ``sql`` (``{p}`` marks the parameters; five columns) as one array, shape (N, 5)."""
    return _fetch_array(session.connection(), sql, parameters, 5, dtype)


#: The binary COPY format's header (signature, flags, header extension length), then per row a field
#: count (int16) and per field its length (int32) and value: big-endian (PostgreSQL's documentation,
#: "COPY", "Binary Format").
_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"


def _fetch_array(connection: sa.Connection, sql: str, parameters: tuple, width: int, dtype) -> np.ndarray:
    """The rows of ``sql`` (``{p}`` marks the parameters; ``width`` numeric columns, no NULL) as one
    array of ``dtype`` (float64 or int64), shape (N, width), in the caller's transaction.

    SQLite: the DBAPI cursor's rows, flattened into the array in one pass. PostgreSQL: ``COPY (...) TO
    STDOUT`` in the binary format with every column cast to ``float8`` (``int8`` for int64), parsed
    with one numpy record dtype: no Python object per value (at K = 100,000 a round has 500,000 rows,
    whose tuples cost more than the query). The values are the same as the rows' (a float8 is sent
    as its bytes; an integer column or sum is exact in float64 below 2^53, as with ``fetchall``)."""
    dtype = np.dtype(dtype)
    if connection.dialect.name == "postgresql":
        data = _copy_array(connection, sql, parameters, width, dtype)
        if data is not None:
            return data
    cursor = connection.connection.cursor()
    try:
        cursor.execute(sql.format(p=_placeholder(connection)), parameters)
        rows = cursor.fetchall()
    finally:
        cursor.close()
    return np.fromiter(itertools.chain.from_iterable(rows), dtype, count=len(rows) * width).reshape(-1, width)


def _copy_array(connection: sa.Connection, sql: str, parameters: tuple, width: int, dtype: np.dtype
                ) -> np.ndarray | None:
    """:func:`_fetch_array` on PostgreSQL (binary COPY); None when the data is not what it expects
    (a NULL), so the caller reads the rows instead."""
    kind = "float8" if dtype.kind == "f" else "int8"
    names = ", ".join(f"c{i}" for i in range(width))
    columns = ", ".join(f"c{i}::{kind}" for i in range(width))
    statement = (f"COPY (SELECT {columns} FROM ({sql.format(p='%s')}) AS q({names})) "
                 "TO STDOUT (FORMAT BINARY)")
    buffer = bytearray()
    cursor = connection.connection.cursor()
    try:
        with cursor.copy(statement, parameters) as copy:
            for block in copy:
                buffer += block
    finally:
        cursor.close()
    if not buffer.startswith(_COPY_SIGNATURE):
        return None
    start = len(_COPY_SIGNATURE) + 8 + int.from_bytes(buffer[len(_COPY_SIGNATURE) + 4:len(_COPY_SIGNATURE) + 8], "big")
    body = memoryview(buffer)[start:len(buffer) - 2]  # the trailer: a field count of -1
    record = np.dtype([("fields", ">i2")] + [(name, f) for i in range(width)
                                              for name, f in ((f"l{i}", ">i4"), (f"v{i}", ">" + dtype.str[1:]))])
    if len(body) % record.itemsize:
        return None
    rows = np.frombuffer(body, dtype=record)
    if (rows["fields"] != width).any() or any((rows[f"l{i}"] != 8).any() for i in range(width)):
        return None
    data = np.empty((len(rows), width), dtype=dtype)
    for i in range(width):
        data[:, i] = rows[f"v{i}"]
    return data


def summarized_rounds(session: Session, experiment_id: int) -> list[int]:
    """The indexes of the rounds whose summary is stored, in order (the summaries themselves are not read)."""
    return session.execute(
        sa.select(Round.index).where(Round.experiment_id == experiment_id, Round.summary.is_not(None))
        .order_by(Round.index)).scalars().all()


def existing_experiment_ids(session: Session, experiment_ids: Sequence[int]) -> set[int]:
    """Those of ``experiment_ids`` that are still experiments (archived included; deleted ones are not)."""
    if not experiment_ids:
        return set()
    return set(session.execute(sa.select(_experiments.c.id).where(_experiments.c.id.in_(experiment_ids))).scalars())


def round_regrets(session: Session, experiment_id: int, indexes: Sequence[int] | None) -> list[tuple[int, Any]]:
    """``(round_index, regret)`` from the stored summaries of rounds ``indexes`` (None: every round with
    one); regret None when the summary has none."""
    query = sa.select(Round.index, Round.summary).where(Round.experiment_id == experiment_id,
                                                        Round.summary.is_not(None))
    if indexes is not None:
        query = query.where(Round.index.in_(indexes))
    return [(index, RoundSummary.load(summary).regret) for index, summary in session.execute(query)]


def traffic_rows(session: Session, experiment_id: int) -> tuple[list, list]:
    """Count rows ``(round_index, arm_index, units, late_observations)`` and ``(index, probabilities)``
    of every round."""
    counts = session.execute(
        sa.select(ArmRoundCount.round_index, ArmRoundCount.arm_index, ArmRoundCount.units,
                  ArmRoundCount.late_observations)
        .where(ArmRoundCount.experiment_id == experiment_id)
    ).all()
    round_probabilities = session.execute(
        sa.select(Round.index, Round.probabilities).where(Round.experiment_id == experiment_id).order_by(Round.index)
    ).all()
    return counts, round_probabilities


def monitoring_versions(session: Session) -> list[sa.Row]:
    """One small row per experiment not archived, what a metrics scrape reads every time: ``id, name,
    status, round_index, applied_rounds, version, updated_at`` and ``summarized`` (whether the latest
    applied round's summary is stored: it is written after the close, without a new version)."""
    latest = sa.select(Round.summary.is_not(None)).where(
        Round.experiment_id == Experiment.id, Round.index == Experiment.applied_rounds - 1).scalar_subquery()
    return session.execute(
        sa.select(Experiment.id, Experiment.name, Experiment.status, Experiment.round_index,
                  Experiment.applied_rounds, Experiment.version, Experiment.updated_at,
                  sa.func.coalesce(latest, False).label("summarized"))
        .where(Experiment.archived_at.is_(None)).order_by(Experiment.id)
    ).all()


def monitoring_rows(session: Session, experiment_ids: Sequence[int]) -> dict[str, Any]:
    """What a metrics scrape needs of experiments ``experiment_ids`` that changes only with their
    version (and the latest summary): configuration and state, the rounds still open or waiting for
    their update and the latest applied one (whose summary holds the newest estimates), the regret
    summed over the rounds, the arm names."""
    experiments = session.execute(
        sa.select(Experiment.id, Experiment.config, Experiment.state).where(Experiment.id.in_(experiment_ids))
    ).all()
    rounds = session.execute(
        sa.select(Round.experiment_id, Round.index, Round.ends_at, Round.probabilities, Round.summary)
        .join(Experiment, Experiment.id == Round.experiment_id)
        .where(Round.index >= Experiment.applied_rounds - 1, Experiment.id.in_(experiment_ids))
    ).all()
    regret_sums = dict(session.execute(
        sa.select(Round.experiment_id, sa.func.sum(Round.summary["regret"].as_float()))
        .where(Round.experiment_id.in_(experiment_ids)).group_by(Round.experiment_id)
    ).all())
    names: dict[int, list[str]] = {}
    for experiment_id, arm_name in session.execute(
        sa.select(Arm.experiment_id, Arm.name).where(Arm.experiment_id.in_(experiment_ids))
        .order_by(Arm.experiment_id, Arm.position)
    ):
        names.setdefault(experiment_id, []).append(arm_name)
    return {"experiments": {row.id: row for row in experiments}, "rounds": rounds, "regret_sums": regret_sums,
            "arm_names": names}


def round_totals(session: Session, experiment_ids: Sequence[int]) -> list[sa.Row]:
    """``(experiment_id, round_index, units, observations, late_observations)`` summed over the arms,
    per experiment and round: the counts a scrape reads each time (they change with every batch). One
    ``round_counts`` row per round, which the writers keep (:func:`add_arm_round_counts`), not a
    GROUP BY over ``arm_round_counts`` (K rows per round)."""
    return session.connection().execute(
        sa.select(RoundCount.experiment_id, RoundCount.round_index, RoundCount.units, RoundCount.observations,
                  RoundCount.late_observations)
        .where(RoundCount.experiment_id.in_(experiment_ids))
        .order_by(RoundCount.experiment_id, RoundCount.round_index)
    ).all()


def arm_units(session: Session, experiment_id: int) -> list[sa.Row]:
    """``(arm_index, units)``: distinct observed units per arm, summed over the rounds."""
    return session.connection().execute(
        sa.select(ArmRoundCount.arm_index, sa.func.sum(ArmRoundCount.units))
        .where(ArmRoundCount.experiment_id == experiment_id).group_by(ArmRoundCount.arm_index)
    ).all()


# ------------------------------------------------------------------------------ scheduler
def write_heartbeat(database: Database, name: str, now: datetime) -> None:
    insert = database.insert(SchedulerHeartbeat)
    with database.write() as session:
        session.execute(
            insert.values(scheduler=name, beat_at=now)
            .on_conflict_do_update(index_elements=["scheduler"], set_={"beat_at": insert.excluded.beat_at})
        )


def last_heartbeat(session: Session) -> datetime | None:
    return session.execute(sa.select(sa.func.max(SchedulerHeartbeat.beat_at))).scalar_one_or_none()


# ------------------------------------------------------------------------------ metric sources
def read_experiment(session: Session, experiment_id: int) -> sa.Row | None:
    """``(name, status, config, round_index, applied_rounds)`` of the experiment without a lock (None: no
    such experiment). Not its state, which is large at K = 10,000 and read on every scheduler tick."""
    e = _experiments.c
    return session.execute(sa.select(e.name, e.status, e.config, e.round_index, e.applied_rounds)
                           .where(e.id == experiment_id)).one_or_none()


def source_round(session: Session, experiment_id: int, round_index: int) -> tuple[dict, dict]:
    """What the source last returned for a round: ``{(arm, metric): (count, sum, sum_of_squares)}`` and
    ``{arm: (units, observations)}``."""
    cells = {(row.arm_index, row.metric_index): (row.count, row.sum, row.sum_of_squares) for row in session.execute(
        sa.select(SourceCell.arm_index, SourceCell.metric_index, SourceCell.count, SourceCell.sum,
                  SourceCell.sum_of_squares)
        .where(SourceCell.experiment_id == experiment_id, SourceCell.round_index == round_index))}
    units = {row.arm_index: (row.units, row.observations) for row in session.execute(
        sa.select(SourceUnits.arm_index, SourceUnits.units, SourceUnits.observations)
        .where(SourceUnits.experiment_id == experiment_id, SourceUnits.round_index == round_index))}
    return cells, units


def replace_source_round(session: Session, experiment_id: int, round_index: int,
                         cells: list[tuple[int, int, int, float, float]], units: list[tuple[int, int, int]]) -> None:
    """Replace the source's rows of a round: ``cells`` ``(arm, metric, count, sum, sum_of_squares)`` and
    ``units`` ``(arm, units, observations)``."""
    session.execute(sa.delete(SourceCell).where(SourceCell.experiment_id == experiment_id,
                                                SourceCell.round_index == round_index))
    session.execute(sa.delete(SourceUnits).where(SourceUnits.experiment_id == experiment_id,
                                                 SourceUnits.round_index == round_index))
    if cells:
        session.execute(sa.insert(SourceCell), [
            {"experiment_id": experiment_id, "round_index": round_index, "arm_index": arm, "metric_index": metric,
             "count": count, "sum": total, "sum_of_squares": squares}
            for arm, metric, count, total, squares in cells])
    if units:
        session.execute(sa.insert(SourceUnits), [
            {"experiment_id": experiment_id, "round_index": round_index, "arm_index": arm, "units": unit_count,
             "observations": observations}
            for arm, unit_count, observations in units])


def source_fetch_started_at(session: Session, experiment_id: int) -> datetime | None:
    """When the query of the source's newest applied result began (None: never)."""
    return session.execute(sa.select(SourceStatus.fetch_started_at)
                           .where(SourceStatus.experiment_id == experiment_id)).scalar_one_or_none()


def source_error(session: Session, experiment_id: int) -> sa.Row | None:
    """``(error, error_since, last_error_at, errors_total)`` of the experiment's source (None: it never
    ran or failed)."""
    return session.execute(
        sa.select(SourceStatus.error, SourceStatus.error_since, SourceStatus.last_error_at,
                  SourceStatus.errors_total).where(SourceStatus.experiment_id == experiment_id)
    ).one_or_none()


def record_source_success(database: Database, session: Session, experiment_id: int, started_at: datetime,
                          now: datetime) -> None:
    """The source's results of a query begun at ``started_at`` were applied: its error is cleared."""
    insert = database.insert(SourceStatus)
    session.execute(
        insert.values(experiment_id=experiment_id, error=None, error_since=None, last_error_at=None, errors_total=0,
                      fetch_started_at=started_at, fetched_at=now)
        .on_conflict_do_update(index_elements=["experiment_id"], set_={
            "error": None, "error_since": None, "fetch_started_at": started_at, "fetched_at": now})
    )


def record_source_failure(database: Database, experiment_id: int, message: str, now: datetime) -> None:
    """A source query failed with ``message``: kept as the experiment's source error (since the first
    failure of the current run), and counted."""
    table = SourceStatus.__table__
    insert = database.insert(SourceStatus)
    with database.write() as session:
        session.execute(
            insert.values(experiment_id=experiment_id, error=message, error_since=now, last_error_at=now,
                          errors_total=1, fetch_started_at=None, fetched_at=None)
            .on_conflict_do_update(index_elements=["experiment_id"], set_={
                "error": message, "last_error_at": now,
                "error_since": sa.func.coalesce(table.c.error_since, now),
                "errors_total": table.c.errors_total + 1})
        )


def source_statuses(session: Session) -> list[sa.Row]:
    """``(experiment_id, name, status, error, error_since, last_error_at, errors_total)`` of every
    experiment whose source has ever run or failed."""
    return session.execute(
        sa.select(SourceStatus.experiment_id, Experiment.name, Experiment.status, SourceStatus.error,
                  SourceStatus.error_since, SourceStatus.last_error_at, SourceStatus.errors_total)
        .join(Experiment, Experiment.id == SourceStatus.experiment_id)
        .order_by(SourceStatus.experiment_id)
    ).all()


# ------------------------------------------------------------------------------ events
def add_event(session: Session, experiment_id: int, kind: str, round_index: int, now: datetime,
              details: dict[str, Any] | None = None) -> None:
    """Record that ``kind`` happened to the experiment in round ``round_index`` (in the caller's
    transaction, so the event commits with the change it records)."""
    session.execute(sa.insert(ExperimentEvent).values(
        experiment_id=experiment_id, kind=kind, round_index=round_index, at=now, details=details))


def add_controller_start(database: Database, scheduler: str, now: datetime) -> int:
    """Record a ``controller_started`` event, in its current round, for every experiment not stopped
    (the ones a scheduler serves or resumes); returns how many were recorded. One statement, so the
    rounds are those of one moment."""
    events = ExperimentEvent.__table__
    with database.write() as session:
        return session.execute(events.insert().from_select(
            ["experiment_id", "kind", "round_index", "at", "details"],
            sa.select(_experiments.c.id, sa.literal("controller_started"), _experiments.c.round_index,
                      sa.literal(now, ExperimentEvent.__table__.c.at.type),
                      sa.literal({"scheduler": scheduler}, ExperimentEvent.__table__.c.details.type))
            .where(_experiments.c.status != "stopped")
            .order_by(_experiments.c.id))).rowcount


def experiment_events(session: Session, experiment_id: int, since: int, limit: int) -> list[sa.Row]:
    """At most ``limit`` events ``(id, kind, round_index, at, details)`` of the experiment with
    ``id >= since``, oldest first."""
    return list(session.execute(
        sa.select(ExperimentEvent.id, ExperimentEvent.kind, ExperimentEvent.round_index, ExperimentEvent.at,
                  ExperimentEvent.details)
        .where(ExperimentEvent.experiment_id == experiment_id, ExperimentEvent.id >= since)
        .order_by(ExperimentEvent.id).limit(limit)))


# ------------------------------------------------------------------------------ API tokens
def hash_token(token: str) -> str:
    """SHA-256 hex digest of ``token``: what the database stores."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_token(session: Session, role: str, name: str, expires_in: float | None = None) -> str:
    """Store a new token for ``role`` and return it; this is the only time it is ever visible (the
    database keeps its SHA-256, ``service.auth.hash_token``).

    ``expires_in``: seconds from now after which the token is refused (None: it does not expire).
    """
    if role not in ROLES:
        raise ValueError(f"The role must be one of {', '.join(ROLES)}, got {role!r}.")
    if expires_in is not None and not (math.isfinite(expires_in) and expires_in > 0):
        raise ValueError(f"A token's lifetime must be a positive number of seconds, got {expires_in!r}.")
    token = secrets.token_urlsafe(32)
    now = utcnow()
    session.add(Token(name=name, role=role, token_hash=hash_token(token), created_at=now,
                      expires_at=None if expires_in is None else now + timedelta(seconds=expires_in)))
    return token


def all_tokens(session: Session) -> list[Token]:
    """Every token row (revoked and expired ones too), oldest first."""
    return list(session.scalars(sa.select(Token).order_by(Token.id)))


def token_by_hash(session: Session, digest: str) -> sa.Row | None:
    """``(token_hash, role, expires_at, revoked_at)`` of the token whose SHA-256 is ``digest`` (None: none)."""
    return session.execute(sa.select(Token.token_hash, Token.role, Token.expires_at, Token.revoked_at)
                           .where(Token.token_hash == digest)).first()


def find_tokens(session: Session, which: str) -> list[Token]:
    """The tokens that are still usable (not revoked, not expired) named by ``which``: a token id
    (digits) or a name. Raises ``LookupError`` with a sentence when none is."""
    now = utcnow()
    query = sa.select(Token).where(Token.revoked_at.is_(None)).order_by(Token.id)
    query = query.where(Token.id == int(which)) if which.isascii() and which.isdigit() and len(which) < 19 \
        else query.where(Token.name == which)
    tokens = [token for token in session.scalars(query) if token.expires_at is None or token.expires_at > now]
    if not tokens:
        raise LookupError(f"No usable token has the id or name {which!r}; `pasto tokens list` shows them.")
    return tokens


def revoke_tokens(session: Session, which: str) -> list[Token]:
    """Revoke every usable token with the id or name ``which``; returns them."""
    tokens = find_tokens(session, which)
    now = utcnow()
    for token in tokens:
        token.revoked_at = now
    return tokens


def rotate_token(session: Session, which: str, grace_seconds: float = 0.0) -> tuple[str, Token]:
    """A new token with the name, role and lifetime of the one token ``which`` names; the old one is
    revoked now, or expires in ``grace_seconds`` (time to deploy the new one). Returns the new token
    and the old row. Raises ``LookupError`` when ``which`` names no usable token or several."""
    tokens = find_tokens(session, which)
    if len(tokens) > 1:
        raise LookupError(f"{len(tokens)} usable tokens are named {which!r} (ids "
                          f"{', '.join(str(token.id) for token in tokens)}); rotate one by its id.")
    (old,) = tokens
    now = utcnow()
    lifetime = None if old.expires_at is None else (old.expires_at - old.created_at).total_seconds()
    token = create_token(session, old.role, old.name, lifetime)
    if grace_seconds > 0:
        grace_end = now + timedelta(seconds=grace_seconds)
        old.expires_at = grace_end if old.expires_at is None else min(old.expires_at, grace_end)
    else:
        old.revoked_at = now
    return token, old


def auth_failures(session: Session, address: str) -> sa.Row | None:
    """``(failures, window_started_at)`` of the invalid tokens counted from ``address`` (None: none)."""
    return session.execute(sa.select(AuthFailure.failures, AuthFailure.window_started_at)
                           .where(AuthFailure.address == address)).first()


def count_auth_failure(database: Database, address: str, now: datetime, window: timedelta) -> int:
    """Count one invalid token from ``address`` in its own transaction, in a window of length
    ``window`` (a window older than that starts again at 1); the failures counted in the window."""
    table = AuthFailure.__table__
    insert = database.insert(table).values(address=address, window_started_at=now, failures=1)
    stale = table.c.window_started_at <= now - window
    statement = insert.on_conflict_do_update(index_elements=["address"], set_={
        "failures": sa.case((stale, 1), else_=table.c.failures + 1),
        "window_started_at": sa.case((stale, insert.excluded.window_started_at), else_=table.c.window_started_at),
    }).returning(table.c.failures)
    with database.write() as session:
        return session.execute(statement).scalar_one()


# ------------------------------------------------------------------------------ the unit of work
class UnitOfWork:
    """What every use case (``service.controller``) is given: the application's database, to open its
    transactions in, and its per-process experiment snapshots.

    A use case opens each transaction with :meth:`read` or :meth:`write` and runs the statements of
    this module in it (``store.lock_experiment(session, experiment_id)``); the few statements that
    open their own transactions take :attr:`database`. :attr:`cache` is the
    :class:`~service.cache.ExperimentCache` (read through this module too).

    The Flask application makes one in ``create_app`` (``service.bootstrap``) and hands it to the use
    cases; a test or a script makes one from a database with :meth:`open`, without any application.
    """

    def __init__(self, database: Database, cache: ExperimentCache) -> None:
        self.database = database
        self.cache = cache

    @classmethod
    def open(cls, database: Database, version_check_seconds: float = 0.05) -> UnitOfWork:
        """A unit of work over ``database`` with a new, empty experiment cache."""
        from .cache import ExperimentCache  # the cache reads through this module

        return cls(database, ExperimentCache(database, version_check_seconds))

    def read(self) -> AbstractContextManager[Session]:
        """A read transaction (:meth:`service.db.Database.read`)."""
        return self.database.read()

    def write(self) -> AbstractContextManager[Session]:
        """One write transaction, committed on success (:meth:`service.db.Database.write`)."""
        return self.database.write()
