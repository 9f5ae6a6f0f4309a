"""The oracle of ``round_counts``: the GROUP BY over ``arm_round_counts`` that ``store.round_totals``
ran before the table existed. Every path that writes the per-arm counts must leave the two equal."""

from __future__ import annotations

import sqlalchemy as sa

from service.models import ArmRoundCount, RoundCount


def grouped_arm_counts(connection: sa.Connection) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``{(experiment_id, round_index): (observations, units, late_observations)}`` summed over the arms."""
    return {(row[0], row[1]): (int(row[2]), int(row[3]), int(row[4])) for row in connection.execute(
        sa.select(ArmRoundCount.experiment_id, ArmRoundCount.round_index, sa.func.sum(ArmRoundCount.observations),
                  sa.func.sum(ArmRoundCount.units), sa.func.sum(ArmRoundCount.late_observations))
        .group_by(ArmRoundCount.experiment_id, ArmRoundCount.round_index))}


def kept_round_counts(connection: sa.Connection) -> dict[tuple[int, int], tuple[int, int, int]]:
    """The same from ``round_counts``, as the writers keep it."""
    return {(row.experiment_id, row.round_index): (row.observations, row.units, row.late_observations)
            for row in connection.execute(sa.select(RoundCount))}


def assert_round_counts_match(engine: sa.Engine) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``round_counts`` equals the GROUP BY over ``arm_round_counts``, every experiment and round;
    returns the totals."""
    with engine.connect() as connection:
        expected, kept = grouped_arm_counts(connection), kept_round_counts(connection)
    assert kept == expected
    return kept
