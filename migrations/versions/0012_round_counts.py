"""Per-round count totals: ``round_counts``, ``arm_round_counts`` summed over the arms, which every
writer of ``arm_round_counts`` keeps in the same transaction, so the dashboard's diagnostics and a
metrics scrape read one row per round instead of grouping K rows per round (957,000 rows at
K = 10,000 after 1,000 rounds).

The upgrade fills it from ``arm_round_counts`` with one ``INSERT ... SELECT ... GROUP BY``; the
downgrade drops it (it holds nothing ``arm_round_counts`` does not).

Stop every writer (``pasto serve``, ``pasto worker``, gunicorn) before upgrading to this revision: the
fill runs once, and a process of the older code still running afterwards writes only
``arm_round_counts``, so the two would disagree for good (docs/api.md, "Running it"). Downgrading to
0011 and upgrading again, with the writers stopped, rebuilds the totals.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    totals = op.create_table('round_counts',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('round_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('observations', sa.BigInteger(), nullable=False),
    sa.Column('units', sa.BigInteger(), nullable=False),
    sa.Column('late_observations', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                            name=op.f('fk_round_counts_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'round_index', name=op.f('pk_round_counts'))
    )
    counts = sa.table("arm_round_counts", sa.column("experiment_id", sa.Integer()),
                      sa.column("round_index", sa.Integer()), sa.column("observations", sa.BigInteger()),
                      sa.column("units", sa.BigInteger()), sa.column("late_observations", sa.BigInteger()))
    op.execute(totals.insert().from_select(
        ["experiment_id", "round_index", "observations", "units", "late_observations"],
        sa.select(counts.c.experiment_id, counts.c.round_index, sa.func.sum(counts.c.observations),
                  sa.func.sum(counts.c.units), sa.func.sum(counts.c.late_observations))
        .group_by(counts.c.experiment_id, counts.c.round_index)))


def downgrade() -> None:
    op.drop_table('round_counts')
