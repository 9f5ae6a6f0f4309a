"""The change detector's snapshots get a table of their own: ``detector_snapshots`` (one row per
experiment and snapshot, ``change_origin`` or ``window_origins``) instead of two keys of
``experiments.state``.

They are the pooled statistics at the last detected change and at the start of each of the
detector's windows: 12 M x K numbers (3 M x K and 9 M x K), against about 7 K for the rest of the
state. Once the detector has looked (round 25 with the defaults), every close rewrote and reread
them inside the state, and every process that reads the experiment (assignment caches, the
dashboard) parsed them: at K = 100,000 and M = 5 the close went from 0.9 s to 1.7 s on SQLite and
to 2.7-4.6 s on PostgreSQL (docs/benchmarks.md). They change only when the detector looks, and only
a look reads the window origins, so the close now reads and writes each row only then
(``service.controller.rounds``).

Data, in one transaction: each experiment's two keys move out of ``state`` into rows as they are
(the packed documents of ``service.models.PackedArraysJSON``, unchanged); the downgrade moves them
back. On PostgreSQL the document column is stored uncompressed (``STORAGE EXTERNAL``, as 0016 does).

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None

NAMES = ("change_origin", "window_origins")

_experiments = sa.table("experiments", sa.column("id", sa.Integer), sa.column("state", sa.JSON))
_snapshots = sa.table("detector_snapshots", sa.column("experiment_id", sa.Integer),
                      sa.column("name", sa.String), sa.column("document", sa.JSON))


def upgrade() -> None:
    op.create_table('detector_snapshots',
    sa.Column('experiment_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=32), nullable=False),
    sa.Column('document', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['experiment_id'], ['experiments.id'],
                            name=op.f('fk_detector_snapshots_experiment_id_experiments'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('experiment_id', 'name', name=op.f('pk_detector_snapshots'))
    )
    connection = op.get_bind()
    if connection.dialect.name == "postgresql":
        op.execute('ALTER TABLE detector_snapshots ALTER COLUMN document SET STORAGE EXTERNAL')
    for experiment_id, state in connection.execute(sa.select(_experiments.c.id, _experiments.c.state)).all():
        if not isinstance(state, dict) or not any(name in state for name in NAMES):
            continue
        moved = {name: state.pop(name) for name in NAMES if name in state}
        for name, document in moved.items():
            if document is not None:
                connection.execute(sa.insert(_snapshots).values(experiment_id=experiment_id, name=name,
                                                                document=document))
        connection.execute(sa.update(_experiments).where(_experiments.c.id == experiment_id).values(state=state))


def downgrade() -> None:
    connection = op.get_bind()
    moved: dict[int, dict] = {}
    for experiment_id, name, document in connection.execute(
            sa.select(_snapshots.c.experiment_id, _snapshots.c.name, _snapshots.c.document)).all():
        moved.setdefault(int(experiment_id), {})[name] = document
    for experiment_id, documents in moved.items():
        state = connection.execute(sa.select(_experiments.c.state).where(_experiments.c.id == experiment_id)).scalar_one()
        connection.execute(sa.update(_experiments).where(_experiments.c.id == experiment_id)
                           .values(state={**state, **documents}))
    op.drop_table('detector_snapshots')
