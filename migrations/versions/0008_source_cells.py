"""Warehouse-native rounds: what each experiment's metric source returned, and its state.

``source_cells`` (per round, arm and metric) and ``source_units`` (per round and arm) hold the
latest result of the source's query for each round; ``round_statistics`` and ``arm_round_counts``
hold the source's part added to the webhook's, so a re-run of a round's query adds only the
difference. ``source_status`` holds the latest error (its sentence, since when), the count of failed
attempts, and when the newest applied query began. The declaration itself is in
``experiments.config["source"]`` (JSON; secrets by environment-variable name only). No data moves.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('source_cells',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('round_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.Column('sum', sa.Double(), nullable=False),
    sa.Column('sum_of_squares', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_source_cells_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'round_index', 'arm_index', 'metric_index', name=op.f('pk_source_cells'))
    )
    op.create_table('source_units',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('round_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('units', sa.BigInteger(), nullable=False),
    sa.Column('observations', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_source_units_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'round_index', 'arm_index', name=op.f('pk_source_units'))
    )
    op.create_table('source_status',
    sa.Column('experiment_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('error_since', sa.DateTime(), nullable=True),
    sa.Column('last_error_at', sa.DateTime(), nullable=True),
    sa.Column('errors_total', sa.BigInteger(), nullable=False),
    sa.Column('fetch_started_at', sa.DateTime(), nullable=True),
    sa.Column('fetched_at', sa.DateTime(), nullable=True),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_source_status_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', name=op.f('pk_source_status'))
    )


def downgrade() -> None:
    op.drop_table('source_status')
    op.drop_table('source_units')
    op.drop_table('source_cells')
