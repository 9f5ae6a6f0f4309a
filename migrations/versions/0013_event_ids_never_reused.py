"""Event ids are never reused: ``experiment_events`` becomes an AUTOINCREMENT table on SQLite.

The events endpoint pages by id (``since``). SQLite gives a table without AUTOINCREMENT the largest
id present plus one, so deleting the experiment holding the newest events (they go with it, ON DELETE
CASCADE) handed their ids to the next events, and a poller holding a ``since`` for a name deleted and
created again missed the new experiment's first events. With AUTOINCREMENT, SQLite keeps the largest
id ever given out in ``sqlite_sequence`` and never goes below it.

On SQLite the table is rebuilt (nothing refers to it, so dropping the old copy cascades nowhere); the
rows keep their ids, and copying them in raises the table's ``sqlite_sequence`` entry to the largest
one. Ids of events deleted before this revision are not recorded anywhere: if they were above every
id kept, the first new events can still get them, once. On PostgreSQL nothing changes: the column's
sequence never goes back. The downgrade rebuilds the table without AUTOINCREMENT on SQLite (its
``sqlite_sequence`` entry goes with the old copy).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    # The rebuild reflects the table (columns, primary key, the foreign key with its ON DELETE
    # CASCADE, the index) and copies the rows with their ids into the new one.
    with op.batch_alter_table("experiment_events", recreate="always",
                              table_kwargs={"sqlite_autoincrement": True}):
        pass


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    # Reflection does not carry AUTOINCREMENT over: the new copy is a plain INTEGER PRIMARY KEY. The
    # primary key gets back the name 0011 gave it (an AUTOINCREMENT key is declared on its column,
    # unnamed), so the table is again the one 0012 left.
    with op.batch_alter_table("experiment_events", recreate="always") as batch_op:
        batch_op.create_primary_key("pk_experiment_events", ["id"])
