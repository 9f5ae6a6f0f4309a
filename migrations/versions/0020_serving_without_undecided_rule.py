"""Stored algorithm options lose ``serving_undecided``.

Safe serving with soft guardrails now serves Thompson sampling over safe mixtures, and a run whose
mixture cannot yet be defended against the best single arm always sends half of its traffic the
way a best-arm bandit would (the former default, ``best_arm``); the option, and its other value
``conservative`` (a path the controller no longer has), are gone. An experiment stored with either
value now serves the one rule.

The downgrade puts back ``serving_undecided = "best_arm"`` where the experiment uses safe serving
(revision 0019's code reads it).

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None

_experiments = sa.table("experiments", sa.column("id", sa.Integer()), sa.column("config", sa.JSON()))


def _rewrite(algorithm_of):
    connection = op.get_bind()
    for experiment_id, config in connection.execute(sa.select(_experiments.c.id, _experiments.c.config)).all():
        algorithm = (config or {}).get("algorithm")
        if isinstance(algorithm, dict):
            rewritten = algorithm_of(algorithm)
            if rewritten != algorithm:
                connection.execute(sa.update(_experiments).where(_experiments.c.id == experiment_id)
                                   .values(config={**config, "algorithm": rewritten}))


def _upgraded(algorithm):
    return {key: value for key, value in algorithm.items() if key != "serving_undecided"}


def _downgraded(algorithm):
    if algorithm.get("serving", "safe") == "safe":
        return {**algorithm, "serving_undecided": "best_arm"}
    return algorithm


def upgrade() -> None:
    _rewrite(_upgraded)


def downgrade() -> None:
    _rewrite(_downgraded)
