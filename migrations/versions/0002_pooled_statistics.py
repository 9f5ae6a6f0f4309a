"""Fold round statistics into running totals: ``round_statistics.folded_*``, a partial index on the
rows with unfolded data, and the ``pooled_statistics`` table.

No backfill: every existing row starts with ``folded_* = 0`` (so all of it is unfolded and in the
partial index) and ``pooled_statistics`` starts empty, so the next round update of each experiment
folds every row of rounds <= the round it applies, which gives the same pooled statistics as the full
aggregate did. Rows of later rounds stay unfolded until their own update, as always.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

UNFOLDED = "count <> folded_count"


def upgrade() -> None:
    # Batch mode: plain ALTER TABLE ... ADD COLUMN on both backends (SQLite allows a constant default
    # with NOT NULL), and the move-and-copy SQLite needs for the downgrade's drop_column.
    with op.batch_alter_table('round_statistics') as batch_op:
        batch_op.add_column(sa.Column('folded_count', sa.BigInteger(), server_default=sa.text('0'), nullable=False))
        batch_op.add_column(sa.Column('folded_sum', sa.Double(), server_default=sa.text('0'), nullable=False))
        batch_op.add_column(sa.Column('folded_sum_of_squares', sa.Double(), server_default=sa.text('0'),
                                      nullable=False))
    op.create_index('ix_round_statistics_unfolded', 'round_statistics', ['experiment_id', 'round_index'],
                    unique=False, sqlite_where=sa.text(UNFOLDED), postgresql_where=sa.text(UNFOLDED))
    op.create_table('pooled_statistics',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.Column('sum', sa.Double(), nullable=False),
    sa.Column('sum_of_squares', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_pooled_statistics_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'metric_index', 'arm_index', name=op.f('pk_pooled_statistics'))
    )


def downgrade() -> None:
    op.drop_table('pooled_statistics')
    op.drop_index('ix_round_statistics_unfolded', table_name='round_statistics')
    with op.batch_alter_table('round_statistics') as batch_op:
        batch_op.drop_column('folded_sum_of_squares')
        batch_op.drop_column('folded_sum')
        batch_op.drop_column('folded_count')
