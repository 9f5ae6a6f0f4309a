"""Estimators: IPS history average (Eq. 5-6), pooled means, control variates, discounting."""

from __future__ import annotations

import numpy as np
import pytest

from pasto.estimators import (
    ESTIMATOR_NAMES,
    Accumulators,
    ControlVariateEstimator,
    IpsEstimator,
    PooledEstimator,
    Statistics,
    control_variate_round_estimate,
    discount_statistics,
    empty_history,
    history_estimate,
    history_update,
    ips_round_estimate,
    make_estimator,
    pooled_estimate,
)

MU = np.array([[2.0, 0.0, -1.0], [-2.0, 2.0, 3.0]])
P = np.array([0.6, 0.3, 0.1])


def _draw_rounds(rng, draws, queries, noise=1.0):
    """Statistics of `draws` independent rounds of `queries` observations each, sampled from P."""
    arms = rng.choice(3, size=(draws, queries), p=P)
    values = MU.T[arms] + noise * rng.standard_normal((draws, queries, 2))
    return Statistics.from_observations(arms, values, n_arms=3)


def test_from_observations_counts_sums_and_missing_metrics():
    arms = np.array([0, 2, 2])
    values = np.array([[1.0, np.nan], [2.0, 5.0], [3.0, 7.0]])
    stats = Statistics.from_observations(arms, values, n_arms=3)
    np.testing.assert_array_equal(stats.counts, [[1, 0, 2], [0, 0, 2]])
    np.testing.assert_array_equal(stats.sums, [[1, 0, 5], [0, 0, 12]])
    np.testing.assert_array_equal(stats.sums_of_squares, [[1, 0, 13], [0, 0, 74]])


def test_statistics_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="same shape"):
        Statistics(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 2)))


def test_pooled_means_standard_errors_and_fallback():
    stats = Statistics(
        counts=np.array([[2.0, 1.0, 0.0]]),
        sums=np.array([[4.0, 3.0, 0.0]]),
        sums_of_squares=np.array([[10.0, 9.0, 0.0]]),
    )
    est = pooled_estimate(stats)
    # Arm 2 has no data: mean of the arms with data, (2 + 3) / 2.
    np.testing.assert_allclose(est.means, [[2.0, 3.0, 2.5]])
    # Arm 0: values 1 and 3 -> s^2 = 2, se = sqrt(2 / 2) = 1. One observation: undefined.
    np.testing.assert_allclose(est.standard_errors[0, 0], 1.0)
    assert np.isnan(est.standard_errors[0, 1]) and np.isnan(est.standard_errors[0, 2])


def test_pooled_without_any_data_is_zero():
    est = pooled_estimate(Statistics.zeros(2, 3))
    np.testing.assert_array_equal(est.means, 0.0)
    assert np.isnan(est.standard_errors).all()


@pytest.mark.parametrize("queries", [1, 10])
def test_ips_round_estimate_is_unbiased(queries):
    rng = np.random.default_rng(1)
    draws = 40_000
    stats = _draw_rounds(rng, draws, queries)
    u = ips_round_estimate(stats, np.broadcast_to(P, (draws, 3)))
    mean = u.mean(axis=0)
    se = u.std(axis=0) / np.sqrt(draws)
    assert np.all(np.abs(mean - MU) < 4 * se)


def test_control_variate_round_estimate_is_unbiased_and_has_less_variance():
    rng = np.random.default_rng(2)
    draws = 40_000
    stats = _draw_rounds(rng, draws, 1)
    baseline = MU + 0.3  # a fixed, slightly wrong baseline
    p = np.broadcast_to(P, (draws, 3))
    u = control_variate_round_estimate(stats, p, baseline)
    mean = u.mean(axis=0)
    se = u.std(axis=0) / np.sqrt(draws)
    assert np.all(np.abs(mean - MU) < 4 * se)
    # Far-from-zero means dominate the IPS variance; the baseline removes them.
    assert u.var(axis=0).sum() < 0.5 * ips_round_estimate(stats, p).var(axis=0).sum()


def test_history_average_matches_algorithm_1_recursion():
    rng = np.random.default_rng(3)
    history = empty_history(2, 3, prior_weight=1.0)
    v = np.zeros((2, 3))  # V_0 = U_0 = 0
    for t in range(1, 30):
        u = rng.normal(size=(2, 3))
        history = history_update(history, u, np.array([True, True]))
        v = t / (t + 1) * v + u / (t + 1)
        np.testing.assert_allclose(history_estimate(history).means, v)


def test_history_skips_metrics_without_observations():
    history = empty_history(2, 1)
    history = history_update(history, np.array([[1.0], [5.0]]), np.array([True, False]))
    history = history_update(history, np.array([[3.0], [7.0]]), np.array([True, True]))
    np.testing.assert_allclose(history_estimate(history).means, [[2.0], [7.0]])


def test_history_standard_error_matches_sample_spread():
    rng = np.random.default_rng(4)
    values = rng.normal(size=(50, 1, 2))
    history = empty_history(1, 2)
    for u in values:
        history = history_update(history, u, np.array([True]))
    est = history_estimate(history)
    np.testing.assert_allclose(est.means, values.mean(axis=0))
    np.testing.assert_allclose(est.standard_errors, values.std(axis=0, ddof=1) / np.sqrt(50))


def test_discounted_statistics_weight_recent_rounds():
    old = Statistics(np.array([[10.0]]), np.array([[10.0]]), np.array([[10.0]]))
    new = Statistics(np.array([[10.0]]), np.array([[30.0]]), np.array([[90.0]]))
    combined = discount_statistics(old, new, 0.5)
    # 5 old observations of 1, 10 new of 3: mean (5 + 30) / 15.
    np.testing.assert_allclose(pooled_estimate(combined).means, [[35.0 / 15.0]])


def test_estimators_accept_batch_dimensions():
    rng = np.random.default_rng(5)
    stats = _draw_rounds(rng, 6, 4)  # batch of 6 rounds treated as 6 runs
    batched = Statistics(stats.counts.reshape(2, 3, 2, 3), stats.sums.reshape(2, 3, 2, 3),
                         stats.sums_of_squares.reshape(2, 3, 2, 3))
    p = np.broadcast_to(P, (2, 3, 3))
    np.testing.assert_allclose(
        ips_round_estimate(batched, p).reshape(6, 2, 3), ips_round_estimate(stats, p.reshape(6, 3))
    )
    np.testing.assert_allclose(
        pooled_estimate(batched).means.reshape(6, 2, 3), pooled_estimate(stats).means
    )


# ---------------------------------------------------------------------------- estimator objects
def _one_round(arms, values):
    return Statistics.from_observations(np.asarray(arms), np.asarray(values, dtype=float), n_arms=3)


def test_make_estimator_chooses_by_name_and_rejects_unknown_names_and_discounts():
    assert ESTIMATOR_NAMES == ("ips", "pooled", "control_variate")
    assert make_estimator("ips", 0.5) == IpsEstimator(discount=0.5)
    assert make_estimator("pooled") == PooledEstimator(discount=1.0)
    assert make_estimator("control_variate").name == "control_variate"
    with pytest.raises(ValueError, match="the estimators are"):
        make_estimator("magic")
    with pytest.raises(ValueError, match="discount must be in"):
        make_estimator("ips", 0.0)


def test_ips_estimator_counts_u0_and_averages_round_estimates():
    estimator = make_estimator("ips")
    accumulators = estimator.start(2, 3)
    np.testing.assert_array_equal(accumulators.history.weights, [1.0, 1.0])  # U_0 = 0 is one round
    assert accumulators.baseline is None and accumulators.discounted is None
    first = _one_round([0, 1], [[2.0, 1.0], [4.0, np.nan]])
    p = np.array([0.5, 0.25, 0.25])
    accumulators = estimator.absorb(accumulators, first, first, p)
    # Metric 0: two observations, U_1 = [2 / (2 * 0.5), 4 / (2 * 0.25), 0]; V_1 = U_1 / 2.
    # Metric 1: one observation, U_1 = [1 / (1 * 0.5), 0, 0]; V_1 = U_1 / 2.
    result = estimator.estimate(accumulators, Statistics.zeros(2, 3))
    np.testing.assert_allclose(result.means, [[1.0, 4.0, 0.0], [1.0, 0.0, 0.0]])
    empty = Statistics.zeros(2, 3)
    unchanged = estimator.absorb(accumulators, empty, first, p)  # a round without data is no round
    np.testing.assert_array_equal(unchanged.history.weights, accumulators.history.weights)


def test_control_variate_estimator_fixes_the_next_baseline_from_pooled_means():
    estimator = make_estimator("control_variate")
    accumulators = estimator.start(2, 3, (4,))
    assert accumulators.history.weights.shape == (4, 2)
    np.testing.assert_array_equal(accumulators.baseline, np.zeros((4, 2, 3)))
    round_statistics = _one_round([0, 0, 2], [[1.0, 0.0], [3.0, 0.0], [5.0, 1.0]])
    pooled = round_statistics + _one_round([1], [[7.0, 2.0]])
    p = np.array([0.5, 0.25, 0.25])
    accumulators = estimator.absorb(estimator.start(2, 3), round_statistics, pooled, p)
    np.testing.assert_allclose(accumulators.baseline, pooled_estimate(pooled).means)
    # With B = 0 the first U is the IPS estimate, and without U_0 it is the estimate itself.
    np.testing.assert_allclose(
        estimator.estimate(accumulators, pooled).means, ips_round_estimate(round_statistics, p)
    )


def test_pooled_estimator_uses_pooled_statistics_or_its_own_discounted_ones():
    first = _one_round([0, 1], [[1.0, 0.0], [3.0, 0.0]])
    second = _one_round([0, 1], [[3.0, 0.0], [3.0, 0.0]])
    plain = make_estimator("pooled")
    assert plain.start(2, 3) == Accumulators()
    assert plain.absorb(Accumulators(), first, first, np.full(3, 1 / 3)) == Accumulators()
    np.testing.assert_allclose(plain.estimate(Accumulators(), first + second).means[0], [2.0, 3.0, 2.5])
    discounted = make_estimator("pooled", 0.5)
    accumulators = discounted.start(2, 3)
    for round_statistics in (first, second):
        accumulators = discounted.absorb(accumulators, round_statistics, first + second, np.full(3, 1 / 3))
    # Arm 0: (0.5 * 1 + 3) / (0.5 + 1) = 7/3; the pooled statistics are not used.
    result = discounted.estimate(accumulators, Statistics.zeros(2, 3))
    assert result.means[0, 0] == pytest.approx(7 / 3)


@pytest.mark.parametrize(
    "estimator, message",
    [(IpsEstimator(), "no history"), (ControlVariateEstimator(), "no history"),
     (PooledEstimator(discount=0.9), "no discounted statistics")],
)
def test_estimators_name_the_accumulator_they_miss(estimator, message):
    with pytest.raises(ValueError, match=message):
        estimator.estimate(Accumulators(), Statistics.zeros(2, 3))
