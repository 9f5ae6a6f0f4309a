"""Per-segment mixtures: the segment dimension of the statistics, in tables of its own.

Segmented experiments keep writing the unsegmented tables (``round_statistics``, ``pooled_statistics``,
``late_statistics``, ``arm_round_counts``) with every segment summed, so the round history, the
sample-ratio test and every existing report read them unchanged. The per-segment statistics go to
three new tables with ``segment_index`` in their keys, written only for segmented experiments:
an unsegmented experiment's SQL, keys and index sizes are exactly what they were (a ``segment_index``
column in the existing keys would widen every row and index entry of every experiment).

- ``segment_round_statistics``: one row per (round, segment, arm, metric);
- ``segment_pooled_statistics`` / ``segment_late_statistics``: the running totals per
  (segment, metric, arm) and the late cells not folded in yet (as 0004 does without segments);
- ``rounds.segment_probabilities``: the S x K propensities served per segment in the round;
- ``experiments.segment_state``: the segmented controller's state (``pasto.segments.SegmentedState``);
  ``experiments.state`` then holds the traffic-weighted aggregate the unsegmented reports read;
- ``segment_value_units``: for an open set of segment values (``{"by": ..., "min_units": N}``), the
  distinct units seen with each value that has no mixture of its own yet (rows deleted when it gets one).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def _statistics_columns() -> list[sa.Column]:
    return [
        sa.Column('count', sa.BigInteger(), nullable=False),
        sa.Column('sum', sa.Double(), nullable=False),
        sa.Column('sum_of_squares', sa.Double(), nullable=False),
    ]


def upgrade() -> None:
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
    op.create_table('segment_value_units',
    sa.Column('experiment_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('value', sa.String(length=128).with_variant(sa.String(length=128, collation='C'), 'postgresql'),
              nullable=False),
    sa.Column('unit', sa.String(length=256).with_variant(sa.String(length=256, collation='C'), 'postgresql'),
              nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                            name=op.f('fk_segment_value_units_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'value', 'unit', name=op.f('pk_segment_value_units'))
    )
    with op.batch_alter_table('rounds') as batch_op:
        batch_op.add_column(sa.Column('segment_probabilities', sa.JSON(), nullable=True))
    with op.batch_alter_table('experiments') as batch_op:
        batch_op.add_column(sa.Column('segment_state', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('experiments') as batch_op:
        batch_op.drop_column('segment_state')
    with op.batch_alter_table('rounds') as batch_op:
        batch_op.drop_column('segment_probabilities')
    op.drop_table('segment_value_units')
    op.drop_table('segment_late_statistics')
    op.drop_table('segment_pooled_statistics')
    op.drop_table('segment_round_statistics')
