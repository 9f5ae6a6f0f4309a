"""Experiment events: ``experiment_events``, what happened to an experiment and in which round
(created, paused, resumed, stopped, controller started), for the dashboard's time axis.

The upgrade records a ``created`` event in round 0 at ``created_at`` for every existing experiment;
their earlier pauses and restarts were never recorded and cannot be recovered. The downgrade drops
the table (the events are a record, nothing else reads them).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    events = op.create_table('experiment_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('round_index', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('details', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                            name=op.f('fk_experiment_events_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_experiment_events'))
    )
    op.create_index('ix_experiment_events_experiment_id_id', 'experiment_events', ['experiment_id', 'id'],
                    unique=False)
    experiments = sa.table("experiments", sa.column("id", sa.Integer()), sa.column("created_at", sa.DateTime()))
    op.execute(events.insert().from_select(
        ["experiment_id", "kind", "round_index", "at"],
        sa.select(experiments.c.id, sa.literal("created"), sa.literal(0), experiments.c.created_at)
        .order_by(experiments.c.id)))


def downgrade() -> None:
    op.drop_index('ix_experiment_events_experiment_id_id', table_name='experiment_events')
    op.drop_table('experiment_events')
