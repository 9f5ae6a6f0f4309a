"""Experiment lifecycle: ``experiments.archived_at`` (archived experiments are stopped and left out of
listings and ``/metrics`` by default) and ``deleted_experiments``, one row per deleted experiment.

``deleted_experiments`` keeps the id of every deleted experiment so that no id is ever given out
twice: SQLite (a table without AUTOINCREMENT) gives a new row the largest id in the table plus one,
so deleting the newest experiment would hand its id to the next one, and a worker still holding the
deleted experiment's cached snapshot would then write into the new one. ``service.store`` picks
SQLite ids above both tables; PostgreSQL's sequence never goes back. (Making the table AUTOINCREMENT
would mean rebuilding ``experiments``, whose DROP cascades into every table referencing it.)

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('experiments', sa.Column('archived_at', sa.DateTime(), nullable=True))
    op.create_table('deleted_experiments',
    sa.Column('id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('deleted_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_deleted_experiments'))
    )


def downgrade() -> None:
    op.drop_table('deleted_experiments')
    # Not batch mode: on SQLite that rebuilds the table, and dropping the old one would cascade into
    # every table referencing it. SQLite has ALTER TABLE ... DROP COLUMN since 3.35 (2021).
    op.execute("ALTER TABLE experiments DROP COLUMN archived_at")
