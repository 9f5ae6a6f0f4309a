"""The statistics a round close reads: round r's own cells exactly as stored, and pooled statistics
added up round by round equal to an independent full aggregate over rounds <= r (counts exactly,
float sums to 1e-12 relative: they are accumulated update by update instead of in one aggregate, so
the last bits can differ), late rows included, on both backends; per segment (S, M, K), one segment
being the unsegmented case."""

from __future__ import annotations

import numpy as np
import pytest
import sqlalchemy as sa

from service.db import get_db
from service.models import Experiment, LateStatistic, RoundStatistic
from service.store import add_statistics, pooled_statistics, update_statistics


def _reference(session, experiment_id: int, round_index: int, shape: tuple[int, int, int]):
    """The full aggregate the fold replaced (commit 4ac4987), per segment: SQLAlchemy rows, per-column lists."""
    table = RoundStatistic.__table__
    in_round = table.c.round_index == round_index

    def round_sum(column):
        return sa.func.sum(sa.case((in_round, column), else_=0))

    rows = session.execute(
        sa.select(table.c.segment_index, table.c.metric_index, table.c.arm_index,
                  round_sum(table.c.count), round_sum(table.c.sum), round_sum(table.c.sum_of_squares),
                  sa.func.sum(table.c.count), sa.func.sum(table.c.sum), sa.func.sum(table.c.sum_of_squares))
        .where(table.c.experiment_id == experiment_id, table.c.round_index <= round_index)
        .group_by(table.c.segment_index, table.c.metric_index, table.c.arm_index)
    ).all()

    def arrays(selected):
        counts, sums, squares = (np.zeros(shape) for _ in range(3))
        if selected:
            segment, metric, arm, count, total, total_of_squares = (list(column) for column in zip(*selected))
            counts[segment, metric, arm] = count
            sums[segment, metric, arm] = total
            squares[segment, metric, arm] = total_of_squares
        return counts, sums, squares

    return (arrays([(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]),
            arrays([(r[0], r[1], r[2], r[6], r[7], r[8]) for r in rows]))


def _as_arrays(statistics):
    return statistics.counts, statistics.sums, statistics.sums_of_squares


def _assert_pooled_equal(got, expected) -> None:
    counts, sums, squares = got
    assert all(array.dtype == np.float64 and array.shape == expected[0].shape for array in got)
    assert np.array_equal(counts, expected[0])
    np.testing.assert_allclose(sums, expected[1], rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(squares, expected[2], rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("n_segments", [1, 3])
def test_running_totals_equal_the_full_aggregate(backend_url, app_factory, setup_a, admin_token, n_segments):
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
    table = RoundStatistic.__table__
    shape = (n_segments, 3, 7)

    def random_rows(rounds):
        return [
            {"experiment_id": experiment_id, "round_index": r, "segment_index": s, "arm_index": k, "metric_index": m,
             "count": int(rng.integers(1, 50)), "sum": float(rng.normal(0, 1e3)),
             "sum_of_squares": float(rng.gamma(2.0, 1e5))}
            for r in rounds for s in range(n_segments) for k in range(7) for m in range(3)
            if rng.random() < 0.7  # some cells empty
        ]

    with database.write() as session:
        session.execute(sa.insert(table), random_rows(range(6)))
    experiments = Experiment.__table__
    for round_index in range(9):  # rounds 6.. have no rows of their own
        if round_index in (3, 6):  # late data for applied rounds, added by ingestion's own function
            with database.write() as session:
                add_statistics(session.connection(), experiment_id,
                               sorted(tuple(row.values())[1:] for row in random_rows(range(round_index - 2))),
                               applied_rounds=round_index)
        with database.write() as session:
            expected_round, expected_pooled = _reference(session, experiment_id, round_index, shape)
            # Read-only pooled statistics before the update: the totals, the late cells, round r's rows.
            _assert_pooled_equal(_as_arrays(pooled_statistics(session, experiment_id, round_index, *shape)),
                                 expected_pooled)
            got_round, got_pooled = update_statistics(database, session, experiment_id, round_index, *shape)
            for got, expected in zip(_as_arrays(got_round), expected_round):
                assert got.dtype == np.float64 and got.shape == shape
                assert np.array_equal(got, expected)  # round r's own rows, read as stored
            _assert_pooled_equal(_as_arrays(got_pooled), expected_pooled)
            # What the close does next in the same transaction: round r is applied.
            session.execute(sa.update(experiments).where(experiments.c.id == experiment_id)
                            .values(applied_rounds=round_index + 1))
            _assert_pooled_equal(_as_arrays(pooled_statistics(session, experiment_id, round_index, *shape)),
                                 expected_pooled)
            assert session.execute(sa.select(sa.func.count()).select_from(LateStatistic)).scalar_one() == 0
    with database.write() as session:
        assert not update_statistics(database, session, experiment_id + 1, 3, *shape)[1].counts.any()  # no rows
    database.engine.dispose()
