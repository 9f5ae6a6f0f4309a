"""A round's summary input, written with its update: ``rounds.summary_input``.

A round's summary (objective, regret, guardrails, lift) is computed after the close transaction
commits, outside the experiment's row lock (the exact optimum behind the regret is the slowest part
of a close at large K). The close now also writes, in its own transaction, what that summary is
computed from: the controller state and pooled statistics right after the round's update (and, for
a segmented experiment, its per-segment state, statistics and shares). The summary write clears it;
a crash or a failed write in between leaves it, and the scheduler's next tick computes the missing
summary from it. Rounds applied before this revision have none (NULL).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("summary_input", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("summary_input")
