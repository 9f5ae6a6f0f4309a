"""Stored algorithm options and controller states follow the learner's current options.

- ``config["algorithm"]`` loses ``serving_posterior_scale`` (the posterior draws are solved exactly
  and served as drawn), an ``serving_undecided`` of ``mixture_draw`` or ``mixture_draw_half`` becomes
  ``best_arm`` (the default), and ``change_level`` now bounds the chance of any false alarm over a
  whole run: the former default 1e-4 per look becomes the new default 0.01 per run (any other value
  is kept, now read as a run-wide level, which is the more conservative reading).
- The controller state (``state``, and ``segment_state["controller"]``) loses ``block_origin``: the
  change detector keeps one origin per window (``window_origins``), which start at the next look.

The downgrade puts back the options' former defaults where this revision set them, which revision
0014's code reads; the windows' origins are dropped (the former single block starts at its next
look).

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

_experiments = sa.table(
    "experiments",
    sa.column("id", sa.Integer()),
    sa.column("config", sa.JSON()),
    sa.column("state", sa.JSON()),
    sa.column("segment_state", sa.JSON()),
)


def _without(state, key):
    if isinstance(state, dict) and key in state:
        return {name: value for name, value in state.items() if name != key}
    return state


def _segment_without(segment_state, key):
    if isinstance(segment_state, dict) and isinstance(segment_state.get("controller"), dict):
        return {**segment_state, "controller": _without(segment_state["controller"], key)}
    return segment_state


def _rewrite(algorithm_of, state_key):
    connection = op.get_bind()
    rows = connection.execute(sa.select(
        _experiments.c.id, _experiments.c.config, _experiments.c.state, _experiments.c.segment_state)).all()
    for experiment_id, config, state, segment_state in rows:
        algorithm = (config or {}).get("algorithm")
        values = {}
        if isinstance(algorithm, dict):
            rewritten = algorithm_of(algorithm)
            if rewritten != algorithm:
                values["config"] = {**config, "algorithm": rewritten}
        if _without(state, state_key) is not state:
            values["state"] = _without(state, state_key)
        if _segment_without(segment_state, state_key) is not segment_state:
            values["segment_state"] = _segment_without(segment_state, state_key)
        if values:
            connection.execute(sa.update(_experiments).where(_experiments.c.id == experiment_id).values(**values))


def _upgraded(algorithm):
    algorithm = {key: value for key, value in algorithm.items() if key != "serving_posterior_scale"}
    if algorithm.get("serving_undecided") in ("mixture_draw", "mixture_draw_half"):
        algorithm["serving_undecided"] = "best_arm"
    if algorithm.get("change_level") == 1e-4:
        algorithm["change_level"] = 0.01
    return algorithm


def _downgraded(algorithm):
    algorithm = dict(algorithm)
    if "serving" in algorithm:
        algorithm.setdefault("serving_posterior_scale", 2.0)
    if algorithm.get("change_level") == 0.01:
        algorithm["change_level"] = 1e-4
    return algorithm


def upgrade() -> None:
    _rewrite(_upgraded, "block_origin")


def downgrade() -> None:
    _rewrite(_downgraded, "window_origins")
