"""PostgreSQL stores the controller states and the summary inputs uncompressed (``STORAGE EXTERNAL``).

``experiments.state``, ``experiments.segment_state`` and ``rounds.summary_input`` hold their large
arrays as float64 bytes in base64 (``service.models.PackedArraysJSON``): at K = 100,000 arms tens of
MB per round close. With the default storage (``EXTENDED``) PostgreSQL tries to compress every such
value before moving it out of line, and float bytes do not compress: the attempt about doubled the
time of writing a 28 MB state (measured beside ``EXTERNAL``, which moves it out of line as it is).
Only the storage strategy of future writes changes: no row is rewritten, no data changes. SQLite has
no such setting: nothing to do there.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

#: (table, column) of the packed documents.
PACKED_COLUMNS = (("experiments", "state"), ("experiments", "segment_state"), ("rounds", "summary_input"))


def _set_storage(storage: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column in PACKED_COLUMNS:
        op.execute(f'ALTER TABLE {table} ALTER COLUMN {column} SET STORAGE {storage}')


def upgrade() -> None:
    _set_storage("EXTERNAL")


def downgrade() -> None:
    _set_storage("EXTENDED")
