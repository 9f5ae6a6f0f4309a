"""One set of statistics tables: ``segment_index`` in the keys of ``round_statistics``,
``pooled_statistics`` and ``late_statistics``; the ``segment_*`` statistics tables of 0009 go.

Until now a segmented experiment wrote every cell twice, in the same transactions: per segment into
``segment_round_statistics`` / ``segment_pooled_statistics`` / ``segment_late_statistics`` and summed
over its segments into the unsegmented tables. Now the statistics tables are keyed by segment too: an
unsegmented experiment has segment 0 only, a segmented one its per-segment rows only, and its totals
over segments are read as sums (``service.store``).

Data, in one transaction:

- every existing row becomes segment 0 (``segment_index`` added NOT NULL with the default 0, which
  is dropped once the rows have it: every writer names the segment);
- for a segmented experiment (``experiments.segment_state`` set), the summed rows are deleted after
  checking, per key and table, that their counts are the sums of the per-segment rows' counts (a
  mismatch stops the upgrade with the keys that differ, changing nothing); its per-segment rows are
  then moved from the ``segment_*`` tables, which are dropped.

The downgrade recreates the ``segment_*`` tables with a segmented experiment's rows and puts the
summed rows back in the unsegmented tables (one row per key, ``SUM`` over segments), then drops the
column. ``segment_value_units``, ``rounds.segment_probabilities`` and ``experiments.segment_state``
(0009) stay.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

VALUES = ("count", "sum", "sum_of_squares")
#: Each statistics table with its key columns after ``experiment_id``, in primary key order (0016's
#: keys, then with the segment), and the ``segment_*`` table of 0009 it absorbs.
ROUND_KEYS = ("round_index", "arm_index", "metric_index")
TOTAL_KEYS = ("metric_index", "arm_index")
TABLES = (
    ("round_statistics", ROUND_KEYS, ("round_index", "segment_index", "arm_index", "metric_index"),
     "segment_round_statistics"),
    ("pooled_statistics", TOTAL_KEYS, ("segment_index", "metric_index", "arm_index"), "segment_pooled_statistics"),
    ("late_statistics", TOTAL_KEYS, ("segment_index", "metric_index", "arm_index"), "segment_late_statistics"),
)


def _segmented_experiments(connection: sa.Connection) -> list[int]:
    """Ids of the segmented experiments: ``segment_state`` holds a document (SQL NULL or JSON null
    for an unsegmented one)."""
    ids = []
    for experiment_id, stored in connection.execute(sa.text(
            "SELECT id, segment_state FROM experiments WHERE segment_state IS NOT NULL ORDER BY id")):
        if isinstance(stored, str):
            stored = json.loads(stored)
        if stored is not None:
            ids.append(int(experiment_id))
    return ids


def _in(ids: list[int]) -> str:
    """``IN (...)`` of integer ids, written out (plain integers from the database, no user text)."""
    return f"IN ({', '.join(str(int(i)) for i in ids)})"


def _check_sums(connection: sa.Connection, segmented: list[int]) -> None:
    """Before the summed rows of the segmented experiments go: per key, their counts must be the sums
    of the per-segment rows' counts (integers: exact), and no other experiment may have per-segment
    rows. Stops the upgrade otherwise."""
    segmented = segmented or [-1]  # none: the checks below then compare nothing to nothing
    problems = []
    for table, keys, _, segment_table in TABLES:
        key = ", ".join(("experiment_id", *keys))
        for left, right in ((table, segment_table), (segment_table, table)):
            # A key of one side that the other lacks, or whose count differs.
            rows = connection.execute(sa.text(
                f"SELECT {key}, SUM(count) AS total FROM {left} WHERE experiment_id {_in(segmented)} "
                f"GROUP BY {key} EXCEPT SELECT {key}, SUM(count) AS total FROM {right} "
                f"WHERE experiment_id {_in(segmented)} GROUP BY {key}")).all()
            problems += [(table, left, tuple(row)) for row in rows[:5]]
    if problems:
        raise RuntimeError(
            "Migration 0017: the summed statistics of segmented experiments differ from the sums of their "
            f"per-segment rows, so they cannot be replaced by them; nothing was changed. First keys that "
            f"differ (table, side, (experiment_id, keys..., count)): {problems}")
    unsegmented = connection.execute(sa.text(
        f"SELECT DISTINCT experiment_id FROM segment_round_statistics WHERE experiment_id NOT {_in(segmented)}"
    )).scalars().all()
    if unsegmented:
        raise RuntimeError(f"Migration 0017: experiments {sorted(unsegmented)} have per-segment statistics but no "
                           "segmented state; nothing was changed.")


def upgrade() -> None:
    connection = op.get_bind()
    segmented = _segmented_experiments(connection)
    _check_sums(connection, segmented)
    for table, _, _, _ in TABLES:
        op.add_column(table, sa.Column('segment_index', sa.Integer(), autoincrement=False, nullable=False,
                                       server_default=sa.text('0')))
        if segmented:
            op.execute(f"DELETE FROM {table} WHERE experiment_id {_in(segmented)}")
    for table, _, keys, _ in TABLES:
        with op.batch_alter_table(table) as batch_op:
            batch_op.alter_column('segment_index', existing_type=sa.Integer(), existing_nullable=False,
                                  server_default=None)
            batch_op.drop_constraint(op.f(f'pk_{table}'), type_='primary')
            batch_op.create_primary_key(op.f(f'pk_{table}'), ['experiment_id', *keys])
    for table, _, keys, segment_table in TABLES:
        columns = ", ".join(("experiment_id", *keys, *VALUES))
        op.execute(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {segment_table}")
    for _, _, _, segment_table in reversed(TABLES):
        op.drop_table(segment_table)


def _statistics_columns() -> list[sa.Column]:
    return [
        sa.Column('count', sa.BigInteger(), nullable=False),
        sa.Column('sum', sa.Double(), nullable=False),
        sa.Column('sum_of_squares', sa.Double(), nullable=False),
    ]


def downgrade() -> None:
    # The segment_* tables as 0009 created them.
    op.create_table('segment_round_statistics',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('round_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('segment_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
    *_statistics_columns(),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                            name=op.f('fk_segment_round_statistics_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'round_index', 'segment_index', 'arm_index', 'metric_index',
                            name=op.f('pk_segment_round_statistics'))
    )
    for table in ('segment_pooled_statistics', 'segment_late_statistics'):
        op.create_table(table,
        sa.Column('experiment_id', sa.Integer(), nullable=False),
        sa.Column('segment_index', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
        *_statistics_columns(),
        sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                                name=op.f(f'fk_{table}_experiment_id_experiments'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('experiment_id', 'segment_index', 'metric_index', 'arm_index', name=op.f(f'pk_{table}'))
        )
    connection = op.get_bind()
    segmented = _segmented_experiments(connection)
    if segmented:
        for table, old_keys, keys, segment_table in TABLES:
            columns = ", ".join(("experiment_id", *keys, *VALUES))
            op.execute(f"INSERT INTO {segment_table} ({columns}) SELECT {columns} FROM {table} "
                       f"WHERE experiment_id {_in(segmented)}")
            op.execute(f"DELETE FROM {table} WHERE experiment_id {_in(segmented)}")
            key = ", ".join(("experiment_id", *old_keys))
            op.execute(f"INSERT INTO {table} ({key}, segment_index, {', '.join(VALUES)}) "
                       f"SELECT {key}, 0, {', '.join(f'SUM({value})' for value in VALUES)} FROM {segment_table} "
                       f"GROUP BY {key}")
    for table, old_keys, _, _ in TABLES:
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_constraint(op.f(f'pk_{table}'), type_='primary')
            batch_op.create_primary_key(op.f(f'pk_{table}'), ['experiment_id', *old_keys])
            batch_op.drop_column('segment_index')
