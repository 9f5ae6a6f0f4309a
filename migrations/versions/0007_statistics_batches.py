"""Statistics batches and retention: ``statistics_batches``, ``experiments.pruned_rounds``, and an index
of ``observation_ids`` by round.

- ``statistics_batches``: one row per batch of pre-aggregated statistics applied
  (``POST .../statistics``), keyed by the client's batch id, with the SHA-256 of its content: a resend
  with the same id and content is answered as a duplicate, the same id with other content is refused.
- ``experiments.pruned_rounds``: rounds below it had their observation ids, units and batch ids deleted
  by retention; data for them is refused (it could no longer be de-duplicated).
- ``ix_observation_ids_round`` (``experiment_id, round_index``): retention deletes the ids of old rounds
  in bounded chunks; without it every chunk would scan the experiment's ids.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == 'postgresql'
    key_type = sa.String(256, collation='C') if postgresql else sa.String(256)
    op.create_table(
        'statistics_batches',
        sa.Column('experiment_id', sa.Integer(), nullable=False),
        sa.Column('batch_id', key_type, nullable=False),
        sa.Column('content_hash', sa.String(64), nullable=False),
        sa.Column('first_round', sa.Integer(), nullable=False),
        sa.Column('last_round', sa.Integer(), nullable=False),
        sa.Column('cells', sa.Integer(), nullable=False),
        sa.Column('received_at', sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint('experiment_id', 'batch_id', name='pk_statistics_batches'),
    )
    with op.batch_alter_table('experiments') as batch_op:
        batch_op.add_column(sa.Column('pruned_rounds', sa.Integer(), nullable=False, server_default='0'))
    op.create_index('ix_observation_ids_round', 'observation_ids', ['experiment_id', 'round_index'])


def downgrade() -> None:
    op.drop_index('ix_observation_ids_round', table_name='observation_ids')
    with op.batch_alter_table('experiments') as batch_op:
        batch_op.drop_column('pruned_rounds')
    op.drop_table('statistics_batches')
