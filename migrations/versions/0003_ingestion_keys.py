"""Ingestion's per-observation tables: no foreign key, and byte-order keys on PostgreSQL.

``observation_ids`` gets one row per accepted observation and ``round_units`` one per distinct unit
of a round, so their inserts are most of an ingestion transaction. Two changes make them cheaper:

- their foreign keys to ``experiments`` go. PostgreSQL checks a foreign key with one trigger call per
  inserted row (about 3.5 ms of each 1,000-row insert, a third of it). The check guarded nothing the
  write path does not already guarantee: ingestion holds a share lock on the experiment's row for the
  whole transaction, so the experiment exists when the rows are written. (No route deletes an
  experiment; whoever deletes one by hand deletes these rows too.)
- on PostgreSQL, ``client_id`` and ``unit`` compare in byte order (``COLLATE "C"``) instead of the
  database's locale: the primary-key index only needs equality and a stable order, and a locale
  comparison costs a ``strcoll`` call per step down the b-tree. SQLite always compares text bytewise.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

KEYS = (('observation_ids', 'client_id'), ('round_units', 'unit'))


def upgrade() -> None:
    postgresql = op.get_bind().dialect.name == 'postgresql'
    for table, column in KEYS:
        # Batch mode: the copy-and-move SQLite needs to drop a constraint; a plain ALTER on PostgreSQL.
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_constraint(f'fk_{table}_experiment_id_experiments', type_='foreignkey')
        if postgresql:
            op.alter_column(table, column, type_=sa.String(256, collation='C'),
                            existing_type=sa.String(256), existing_nullable=False)


def downgrade() -> None:
    postgresql = op.get_bind().dialect.name == 'postgresql'
    for table, column in KEYS:
        if postgresql:
            op.alter_column(table, column, type_=sa.String(256), existing_type=sa.String(256, collation='C'),
                            existing_nullable=False)
        with op.batch_alter_table(table) as batch_op:
            batch_op.create_foreign_key(f'fk_{table}_experiment_id_experiments', 'experiments',
                                        ['experiment_id'], ['id'], ondelete='CASCADE')
