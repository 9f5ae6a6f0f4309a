"""Running totals as arrays: ``pooled_arrays`` (one row per experiment, segment and metric holding
the K arms' count, sum and sum of squares as float64 bytes) replaces ``pooled_statistics`` (one row
per experiment, segment, metric and arm).

Every round close added the round's cells into the totals and read them back: at K = 100,000 and
M = 5 that is an upsert of 500,000 rows and a read of 500,000 more, 5 to 7 s of a close on
PostgreSQL and 2 to 4 s on SQLite (docs/benchmarks.md). With one row per (segment, metric) a close
reads S x M rows, adds the round's cells in numpy and writes them back (``service.store``).

Data, in one transaction: each experiment's rows are gathered into arrays of K = its number of arms
(a row whose ``arm_index`` is not one of its arms stops the upgrade, changing nothing); every array
written is read back and checked against the rows it came from (each value equal, bit for bit, and
zeros where there was no row) before ``pooled_statistics`` is dropped. On PostgreSQL the array
columns are stored uncompressed (``STORAGE EXTERNAL``, as 0016 does for the packed documents: float
bytes do not compress, and trying costs time on every write).

The downgrade recreates ``pooled_statistics`` as 0017 left it with a row for every arm whose count,
sum or sum of squares is not zero (a row of zeros reads as no row, so nothing the service reads
changes), checks each experiment's totals per (segment, metric) against the arrays, and drops
``pooled_arrays``.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

VALUES = ("count", "sum", "sum_of_squares")
DTYPE = np.dtype("<f8")  # service.models.ARRAY_DTYPE


def _arm_counts(connection: sa.Connection) -> dict[int, int]:
    """Number of arms per experiment (positions 0..K-1)."""
    return {int(e): int(k) for e, k in connection.execute(sa.text(
        "SELECT experiment_id, COUNT(*) FROM arms GROUP BY experiment_id"))}


def upgrade() -> None:
    op.create_table('pooled_arrays',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('segment_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('count', sa.LargeBinary(), nullable=False),
    sa.Column('sum', sa.LargeBinary(), nullable=False),
    sa.Column('sum_of_squares', sa.LargeBinary(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                            name=op.f('fk_pooled_arrays_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'segment_index', 'metric_index', name=op.f('pk_pooled_arrays'))
    )
    connection = op.get_bind()
    if connection.dialect.name == "postgresql":
        for column in VALUES:
            op.execute(f'ALTER TABLE pooled_arrays ALTER COLUMN {column} SET STORAGE EXTERNAL')
    arms = _arm_counts(connection)
    rows = connection.execute(sa.text(
        "SELECT experiment_id, segment_index, metric_index, arm_index, count, sum, sum_of_squares "
        "FROM pooled_statistics ORDER BY experiment_id, segment_index, metric_index, arm_index")).all()
    cells: dict[tuple[int, int, int], list[tuple]] = defaultdict(list)
    problems = []
    for experiment_id, segment, metric, arm, *values in rows:
        if not 0 <= arm < arms.get(experiment_id, 0):
            problems.append((experiment_id, segment, metric, arm))
        cells[(int(experiment_id), int(segment), int(metric))].append((int(arm), *values))
    if problems:
        raise RuntimeError("Migration 0018: pooled_statistics has rows for arms the experiment does not have, so "
                           "they cannot be stored as arrays of its arms; nothing was changed. First rows "
                           f"(experiment_id, segment_index, metric_index, arm_index): {problems[:5]}")
    expected = {}
    for key, key_cells in cells.items():
        arrays = np.zeros((3, arms[key[0]]), dtype=DTYPE)
        index = np.array([cell[0] for cell in key_cells], dtype=np.int64)
        for v in range(3):
            arrays[v, index] = [float(cell[1 + v]) for cell in key_cells]
        expected[key] = arrays
        connection.execute(sa.text(
            "INSERT INTO pooled_arrays (experiment_id, segment_index, metric_index, count, sum, sum_of_squares) "
            "VALUES (:e, :s, :m, :count, :sum, :sum_of_squares)"),
            {"e": key[0], "s": key[1], "m": key[2],
             **{name: arrays[v].tobytes() for v, name in enumerate(VALUES)}})
    stored = {(int(e), int(s), int(m)): np.stack([np.frombuffer(bytes(value), dtype=DTYPE) for value in values])
              for e, s, m, *values in connection.execute(sa.text(
                  "SELECT experiment_id, segment_index, metric_index, count, sum, sum_of_squares FROM pooled_arrays"))}
    differ = [key for key in expected if key not in stored or stored[key].tobytes() != expected[key].tobytes()]
    if differ or len(stored) != len(expected):
        raise RuntimeError(f"Migration 0018: the arrays read back differ from the rows they were made of: {differ[:5]}")
    op.drop_table('pooled_statistics')


def downgrade() -> None:
    # pooled_statistics as 0017 left it (segment_index last: 0017 added it to 0004's table).
    op.create_table('pooled_statistics',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.Column('sum', sa.Double(), nullable=False),
    sa.Column('sum_of_squares', sa.Double(), nullable=False),
    sa.Column('segment_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                            name=op.f('fk_pooled_statistics_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'segment_index', 'metric_index', 'arm_index',
                            name=op.f('pk_pooled_statistics'))
    )
    connection = op.get_bind()
    expected = {}
    for e, s, m, *values in connection.execute(sa.text(
            "SELECT experiment_id, segment_index, metric_index, count, sum, sum_of_squares FROM pooled_arrays "
            "ORDER BY experiment_id, segment_index, metric_index")).all():
        count, total, squares = (np.frombuffer(bytes(value), dtype=DTYPE) for value in values)
        if not np.array_equal(count, np.round(count)):
            raise RuntimeError(f"Migration 0018 (downgrade): experiment {e} has counts that are not integers; "
                               "nothing was changed.")
        arms = np.flatnonzero((count != 0) | (total != 0) | (squares != 0))
        expected[(int(e), int(s), int(m))] = (int(count.sum()), len(arms))
        rows = [{"e": int(e), "s": int(s), "m": int(m), "k": int(k), "count": int(count[k]), "sum": float(total[k]),
                 "sum_of_squares": float(squares[k])} for k in arms]
        if rows:
            connection.execute(sa.text(
                "INSERT INTO pooled_statistics (experiment_id, segment_index, metric_index, arm_index, count, sum, "
                "sum_of_squares) VALUES (:e, :s, :m, :k, :count, :sum, :sum_of_squares)"), rows)
    written = {(int(e), int(s), int(m)): (int(total), int(rows)) for e, s, m, total, rows in connection.execute(sa.text(
        "SELECT experiment_id, segment_index, metric_index, SUM(count), COUNT(*) FROM pooled_statistics "
        "GROUP BY experiment_id, segment_index, metric_index"))}
    if written != {key: value for key, value in expected.items() if value[1]}:
        raise RuntimeError("Migration 0018 (downgrade): the rows written differ from the arrays; nothing was changed.")
    op.drop_table('pooled_arrays')
