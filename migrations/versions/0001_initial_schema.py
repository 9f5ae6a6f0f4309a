"""Initial schema: experiments, arms, rounds, sufficient statistics, idempotency keys, tokens.

Datetimes are stored as naive UTC (service.models.UTCDateTime converts).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('experiments',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('round_index', sa.Integer(), nullable=False),
    sa.Column('applied_rounds', sa.Integer(), nullable=False),
    sa.Column('state', sa.JSON(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_experiments')),
    sa.UniqueConstraint('name', name=op.f('uq_experiments_name'))
    )
    op.create_table('scheduler_heartbeats',
    sa.Column('scheduler', sa.String(length=128), nullable=False),
    sa.Column('beat_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('scheduler', name=op.f('pk_scheduler_heartbeats'))
    )
    op.create_table('tokens',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_tokens_token_hash'))
    )
    op.create_table('arm_round_counts',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('round_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('observations', sa.BigInteger(), nullable=False),
    sa.Column('units', sa.BigInteger(), nullable=False),
    sa.Column('late_observations', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_arm_round_counts_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'round_index', 'arm_index', name=op.f('pk_arm_round_counts'))
    )
    op.create_table('arms',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('position', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_arms_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'position', name=op.f('pk_arms')),
    sa.UniqueConstraint('experiment_id', 'name', name=op.f('uq_arms_experiment_id_name'))
    )
    op.create_table('observation_ids',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('client_id', sa.String(length=256), nullable=False),
    sa.Column('round_index', sa.Integer(), nullable=False),
    sa.Column('arm_index', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_observation_ids_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'client_id', name=op.f('pk_observation_ids'))
    )
    op.create_table('round_statistics',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('round_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('arm_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('metric_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.Column('sum', sa.Double(), nullable=False),
    sa.Column('sum_of_squares', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_round_statistics_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'round_index', 'arm_index', 'metric_index', name=op.f('pk_round_statistics'))
    )
    op.create_table('round_units',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('round_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('unit', sa.String(length=256), nullable=False),
    sa.Column('arm_index', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_round_units_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'round_index', 'unit', name=op.f('pk_round_units'))
    )
    op.create_table('rounds',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('ends_at', sa.DateTime(), nullable=False),
    sa.Column('closed_at', sa.DateTime(), nullable=True),
    sa.Column('applied_at', sa.DateTime(), nullable=True),
    sa.Column('probabilities', sa.JSON(), nullable=False),
    sa.Column('deployed', sa.JSON(), nullable=True),
    sa.Column('summary', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'], name=op.f('fk_rounds_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'index', name=op.f('pk_rounds'))
    )


def downgrade() -> None:
    op.drop_table('rounds')
    op.drop_table('round_units')
    op.drop_table('round_statistics')
    op.drop_table('observation_ids')
    op.drop_table('arms')
    op.drop_table('arm_round_counts')
    op.drop_table('tokens')
    op.drop_table('scheduler_heartbeats')
    op.drop_table('experiments')
