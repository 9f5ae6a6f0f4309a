"""Late data kept apart: the ``late_statistics`` table replaces ``round_statistics.folded_*`` and the
partial index on ``count <> folded_count``.

With 0002 every ingestion upsert changed a column of the partial index's predicate, so no update of a
``round_statistics`` row could be a heap-only (HOT) update on PostgreSQL, and every close wrote its
K x M rows twice (the totals, then ``folded_* = current``). Now ingestion adds late observations (for
rounds already applied) to ``late_statistics`` as well, under the same share lock on the experiment
that decides they are late, and a round update adds its round's rows (read only) plus the late cells
into ``pooled_statistics`` and empties ``late_statistics``.

Data: the unfolded part of rows of applied rounds (late data not folded yet; rows of rounds not
applied were never folded) moves into ``late_statistics``, so the totals plus the late cells are the
same pooled statistics as before. The downgrade folds the late cells into the totals and marks the
rows of applied rounds folded, which is again the same.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

UNFOLDED = "count <> folded_count"
STATISTICS = ("count", "sum", "sum_of_squares")
APPLIED = ("round_statistics.round_index < (SELECT applied_rounds FROM experiments "
           "WHERE experiments.id = round_statistics.experiment_id)")


def upgrade() -> None:
    op.create_table('late_statistics',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.Column('sum', sa.Double(), nullable=False),
    sa.Column('sum_of_squares', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_late_statistics_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'metric_index', 'arm_index', name=op.f('pk_late_statistics'))
    )
    op.execute(
        "INSERT INTO late_statistics (experiment_id, metric_index, arm_index, count, sum, sum_of_squares) "
        "SELECT experiment_id, metric_index, arm_index, SUM(count - folded_count), SUM(sum - folded_sum), "
        "SUM(sum_of_squares - folded_sum_of_squares) FROM round_statistics "
        f"WHERE {UNFOLDED} AND {APPLIED} GROUP BY experiment_id, metric_index, arm_index"
    )
    op.drop_index('ix_round_statistics_unfolded', table_name='round_statistics')
    with op.batch_alter_table('round_statistics') as batch_op:
        batch_op.drop_column('folded_sum_of_squares')
        batch_op.drop_column('folded_sum')
        batch_op.drop_column('folded_count')


def downgrade() -> None:
    with op.batch_alter_table('round_statistics') as batch_op:
        batch_op.add_column(sa.Column('folded_count', sa.BigInteger(), server_default=sa.text('0'), nullable=False))
        batch_op.add_column(sa.Column('folded_sum', sa.Double(), server_default=sa.text('0'), nullable=False))
        batch_op.add_column(sa.Column('folded_sum_of_squares', sa.Double(), server_default=sa.text('0'),
                                      nullable=False))
    op.execute(f"UPDATE round_statistics SET folded_count = count, folded_sum = sum, "
               f"folded_sum_of_squares = sum_of_squares WHERE {APPLIED}")
    op.execute(
        "INSERT INTO pooled_statistics (experiment_id, metric_index, arm_index, count, sum, sum_of_squares) "
        "SELECT experiment_id, metric_index, arm_index, count, sum, sum_of_squares FROM late_statistics "
        "WHERE true ON CONFLICT (experiment_id, metric_index, arm_index) DO UPDATE SET "
        + ", ".join(f"{column} = pooled_statistics.{column} + excluded.{column}" for column in STATISTICS)
    )
    op.create_index('ix_round_statistics_unfolded', 'round_statistics', ['experiment_id', 'round_index'],
                    unique=False, sqlite_where=sa.text(UNFOLDED), postgresql_where=sa.text(UNFOLDED))
    op.drop_table('late_statistics')
