"""Hypothesis properties of the update: simplex, exploration floor, overflow safety, determinism,
batch equivalence; concavity of the objective."""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pasto.algorithm import AlgorithmConfig, exploration_rate, initial_state, round_generator, update
from pasto.estimators import Statistics, pooled_estimate
from pasto.objectives import Objective
from pasto.simulate import sample_arms

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _objective(n_metrics: int, penalty: float = 5.0, threshold: float = 0.2) -> Objective:
    names = [f"m{i}" for i in range(n_metrics)]
    guardrails = [{"metric": name, "threshold": threshold, "penalty": penalty} for name in names[1:]]
    return Objective.from_spec(names, {"primary": names[0], "guardrails": guardrails})


configs = st.one_of(
    st.just(AlgorithmConfig.from_preset("paper")),
    st.just(AlgorithmConfig.from_preset("default")),
    st.builds(
        lambda estimator, schedule, exploration, deploy, solve_every, discount, directed, dual, hedge, serving: (
            # Safe serving has no exploration options (from_preset refuses them): it varies the estimator.
            AlgorithmConfig.from_preset("default", serving="safe", estimator=estimator, discount=discount)
            if serving == "safe" else
            AlgorithmConfig.from_preset(
                "default",
                serving=serving,
                estimator=estimator,
                step_schedule=schedule,
                step_size=1.0,
                horizon=50,
                stage_length=3,
                exploration=exploration,
                exploration_scale=0.3,
                deploy=deploy,
                solve_every=solve_every,
                solve_steps=10,
                discount=discount,
                directed_share=directed,
                guardrail_weights=dual,
                solve_objective=hedge,
            )
        ),
        st.sampled_from(["ips", "pooled", "control_variate"]),
        st.sampled_from(["constant", "per_arm", "horizon", "doubling", "adagrad"]),
        st.sampled_from(["paper", "sqrt", "constant"]),
        st.sampled_from(["average", "stage", "last"]),
        st.sampled_from([0, 1, 3]),
        st.sampled_from([1.0, 0.8]),
        st.sampled_from([0.0, 0.3]),
        st.sampled_from(["fixed", "dual_ascent"]),
        st.sampled_from(["plug_in", "expected"]),
        st.sampled_from(["exploration", "safe"]),
    ),
)


def _draw(rng, probabilities, queries):
    """Arms (batch..., queries) drawn from the served ``probabilities`` (batch..., K)."""
    flat = probabilities.reshape(-1, probabilities.shape[-1])
    return sample_arms(rng, flat, queries).reshape(probabilities.shape[:-1] + (queries,))


def _run(config, objective, n_arms, rounds, seed, scale=1.0, batch=(), queries=3, check=None):
    rng = np.random.default_rng(seed)
    m = objective.n_metrics
    means = scale * rng.uniform(-1, 1, size=batch + (m, n_arms))
    state = initial_state(config, n_arms, m, batch, objective=objective)
    pooled = Statistics.zeros(m, n_arms, batch)
    for round_number in range(1, rounds + 1):
        arms = _draw(rng, state.probabilities, queries)
        values = np.take_along_axis(
            np.swapaxes(means, -1, -2), arms[..., None], axis=-2
        ) + scale * rng.standard_normal(batch + (queries, m))
        round_stats = Statistics.from_observations(arms, values, n_arms)
        pooled = pooled + round_stats
        state = update(config, objective, state, round_stats, pooled, rng=round_generator(0, round_number))
        if check is not None:
            check(state)
    return state


def _assert_valid(config, n_arms):
    def check(state):
        for p in (state.probabilities, state.deployed):
            assert np.all(np.isfinite(p))
            assert np.all(np.abs(p.sum(axis=-1) - 1.0) <= 1e-12)
            assert np.all(p >= 0)
        if not config.safe:  # safe serving has no exploration floor
            eps = exploration_rate(config.exploration, state.round_index + 1)
            assert np.all(state.probabilities >= eps / n_arms * (1 - 1e-12))
        assert np.all(np.isfinite(state.log_weights))

    return check


@SETTINGS
@given(configs, st.integers(1, 12), st.integers(1, 4), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_probabilities_stay_on_simplex_above_exploration_floor(config, n_arms, n_metrics, rounds, seed):
    objective = _objective(n_metrics)
    _run(config, objective, n_arms, rounds, seed, check=_assert_valid(config, n_arms))


@SETTINGS
@given(configs, st.integers(2, 6), st.integers(0, 2**32 - 1), st.floats(1e100, 1e150), st.floats(1.0, 1e100))
def test_huge_metrics_and_penalties_do_not_overflow(config, n_arms, seed, scale, penalty):
    # Metric values up to 1e150 (squares up to 1e300) and penalties up to 1e100: the raw
    # gradients are far beyond float range.
    objective = _objective(3, penalty=penalty, threshold=0.5 * scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _run(config, objective, n_arms, 6, seed, scale=scale, check=_assert_valid(config, n_arms))


@SETTINGS
@given(configs, st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_same_inputs_same_result(config, n_arms, seed):
    objective = _objective(2)
    first = _run(config, objective, n_arms, 5, seed)
    second = _run(config, objective, n_arms, 5, seed)
    assert first.to_dict() == second.to_dict()


@SETTINGS
@given(configs, st.integers(1, 5), st.integers(0, 2**32 - 1))
# The deploy test's Student-t scales were drawn for the batch at once, so the third run of a batch
# deployed a step of 0.8 where alone it deployed 0.6.
@example(AlgorithmConfig.from_preset("default"), 3, 397)
def test_batched_update_equals_per_run_updates(config, n_arms, seed):
    objective = _objective(2)
    rng = np.random.default_rng(seed)
    batch = 3
    state = initial_state(config, n_arms, 2, (batch,), objective=objective)
    singles = [initial_state(config, n_arms, 2, objective=objective) for _ in range(batch)]
    pooled = Statistics.zeros(2, n_arms, (batch,))
    for round_number in range(1, 5):
        arms = _draw(rng, state.probabilities, 3)
        values = rng.normal(size=(batch, 3, 2))
        round_stats = Statistics.from_observations(arms, values, n_arms)
        pooled = pooled + round_stats
        state = update(config, objective, state, round_stats, pooled, rng=round_generator(0, round_number))
        for b in range(batch):
            singles[b] = update(
                config,
                objective,
                singles[b],
                Statistics(round_stats.counts[b], round_stats.sums[b], round_stats.sums_of_squares[b]),
                Statistics(pooled.counts[b], pooled.sums[b], pooled.sums_of_squares[b]),
                rng=round_generator(0, round_number),
            )
    for b in range(batch):
        np.testing.assert_allclose(state.probabilities[b], singles[b].probabilities, rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(state.deployed[b], singles[b].deployed, rtol=1e-9, atol=1e-15)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-5, 5), min_size=3, max_size=3),
    st.lists(st.floats(-5, 5), min_size=3, max_size=3),
    st.floats(0, 1),
    st.floats(0, 50),
)
def test_objective_is_concave(x1, x2, share, penalty):
    objective = _objective(3, penalty=penalty)
    thresholds = np.array([0.2, 0.2])
    x1, x2 = np.array(x1), np.array(x2)
    mixed = objective.value(share * x1 + (1 - share) * x2, thresholds)
    chord = share * objective.value(x1, thresholds) + (1 - share) * objective.value(x2, thresholds)
    assert mixed >= chord - 1e-9 * (1 + abs(chord))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.floats(-1e6, 1e6)), min_size=1, max_size=30),
)
def test_pooled_means_lie_within_the_observed_range(observations):
    arms = np.array([arm for arm, _ in observations])
    values = np.array([[value] for _, value in observations])
    estimate = pooled_estimate(Statistics.from_observations(arms, values, 4))
    low, high = values.min(), values.max()
    span = 1e-9 * (1 + abs(low) + abs(high))
    assert np.all((estimate.means >= low - span) & (estimate.means <= high + span))
    assert np.all(np.isnan(estimate.standard_errors) | (estimate.standard_errors >= 0))
