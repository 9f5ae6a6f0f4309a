"""What an experiment stores is exactly what it runs: ``experiments.config["algorithm"]`` loses the
``preset`` key.

Experiments created before this revision stored the preset the request named beside the resolved
``AlgorithmConfig`` fields, and the round update stripped it again before use; the service now stores
the resolved configuration only (``service.controller.experiments``). The upgrade removes the key
from existing rows, so every row reads the same way. The downgrade changes nothing: the code of
revision 0005 reads rows without the key (it never used it), and which preset a row was created with
cannot be recovered once the key is gone.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

_experiments = sa.table("experiments", sa.column("id", sa.Integer()), sa.column("config", sa.JSON()))


def upgrade() -> None:
    connection = op.get_bind()
    rows = connection.execute(sa.select(_experiments.c.id, _experiments.c.config)).all()
    for experiment_id, config in rows:
        algorithm = (config or {}).get("algorithm")
        if isinstance(algorithm, dict) and "preset" in algorithm:
            resolved = {key: value for key, value in algorithm.items() if key != "preset"}
            connection.execute(sa.update(_experiments).where(_experiments.c.id == experiment_id)
                               .values(config={**config, "algorithm": resolved}))


def downgrade() -> None:
    pass
