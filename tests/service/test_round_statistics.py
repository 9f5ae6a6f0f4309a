"""The statistics a round close reads: the same arrays, to the last bit, as the SQLAlchemy-row version
they replaced (kept here as the reference), on both backends."""

from __future__ import annotations

import numpy as np
import sqlalchemy as sa

from service.db import get_db
from service.models import Experiment, RoundStatistic
from service.rounds import pooled_statistics, update_statistics


def _reference(session, experiment_id: int, round_index: int, n_metrics: int, n_arms: int):
    """update_statistics as it was (commit 4ac4987): SQLAlchemy rows, per-column lists."""
    table = RoundStatistic.__table__
    in_round = table.c.round_index == round_index

    def round_sum(column):
        return sa.func.sum(sa.case((in_round, column), else_=0))

    rows = session.execute(
        sa.select(table.c.metric_index, table.c.arm_index,
                  round_sum(table.c.count), round_sum(table.c.sum), round_sum(table.c.sum_of_squares),
                  sa.func.sum(table.c.count), sa.func.sum(table.c.sum), sa.func.sum(table.c.sum_of_squares))
        .where(table.c.experiment_id == experiment_id, table.c.round_index <= round_index)
        .group_by(table.c.metric_index, table.c.arm_index)
    ).all()

    def arrays(selected):
        counts, sums, squares = (np.zeros((n_metrics, n_arms)) for _ in range(3))
        if selected:
            metric, arm, count, total, total_of_squares = (list(column) for column in zip(*selected))
            counts[metric, arm] = count
            sums[metric, arm] = total
            squares[metric, arm] = total_of_squares
        return counts, sums, squares

    return (arrays([(r[0], r[1], r[2], r[3], r[4]) for r in rows]),
            arrays([(r[0], r[1], r[5], r[6], r[7]) for r in rows]))


def _as_arrays(statistics):
    return statistics.counts, statistics.sums, statistics.sums_of_squares


def test_update_statistics_equals_the_reference_bit_for_bit(backend_url, app_factory, setup_a, admin_token):
    app = app_factory(backend_url)
    client = app.test_client()
    arms = [{"name": f"arm-{k}"} for k in range(7)]
    body = setup_a(arms=arms, metrics=["x", "y", "z"], objective={"primary": "x"})
    assert client.post("/api/v1/experiments", json=body,
                       headers={"Authorization": f"Bearer {admin_token}"}).status_code == 201
    database = get_db(app)
    with database.read() as session:
        experiment_id = session.execute(sa.select(Experiment.id)).scalar_one()
    rng = np.random.default_rng(5)
    rows = [
        {"experiment_id": experiment_id, "round_index": r, "arm_index": k, "metric_index": m,
         "count": int(rng.integers(1, 50)), "sum": float(rng.normal(0, 1e3)), "sum_of_squares": float(rng.gamma(2.0, 1e5))}
        for r in range(6) for k in range(7) for m in range(3) if rng.random() < 0.7  # some cells empty
    ]
    with database.write() as session:
        session.execute(sa.insert(RoundStatistic.__table__), rows)
    with database.read() as session:
        for round_index in range(7):  # round 6 has no rows at all
            expected_round, expected_pooled = _reference(session, experiment_id, round_index, 3, 7)
            got_round, got_pooled = update_statistics(session, experiment_id, round_index, 3, 7)
            for got, expected in zip(_as_arrays(got_round) + _as_arrays(got_pooled), expected_round + expected_pooled):
                assert got.dtype == np.float64 and got.shape == (3, 7)
                assert np.array_equal(got, expected)
            pooled = pooled_statistics(session, experiment_id, round_index, 3, 7)
            for got, expected in zip(_as_arrays(pooled), expected_pooled):
                assert np.array_equal(got, expected)
        assert not update_statistics(session, experiment_id + 1, 3, 3, 7)[1].counts.any()  # no rows at all
    database.engine.dispose()
