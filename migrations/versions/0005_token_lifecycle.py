"""Token lifecycle: ``tokens.expires_at`` and ``tokens.revoked_at`` (both optional), and
``auth_failures``, the per-address count of invalid tokens that throttles guessing.

Existing tokens keep working: no expiry, not revoked. The downgrade drops the columns, so tokens
revoked meanwhile would work again: it deletes the revoked (and expired) ones first.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tokens') as batch_op:
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column('revoked_at', sa.DateTime(), nullable=True))
    op.create_table('auth_failures',
    sa.Column('address', sa.String(length=64), nullable=False),
    sa.Column('window_started_at', sa.DateTime(), nullable=False),
    sa.Column('failures', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('address', name=op.f('pk_auth_failures'))
    )


def downgrade() -> None:
    op.drop_table('auth_failures')
    op.execute("DELETE FROM tokens WHERE revoked_at IS NOT NULL OR expires_at IS NOT NULL")
    with op.batch_alter_table('tokens') as batch_op:
        batch_op.drop_column('revoked_at')
        batch_op.drop_column('expires_at')
