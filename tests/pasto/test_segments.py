"""Per-segment mixtures: the joint LP against vertex enumeration, shrinkage, one segment = unsegmented."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasto import algorithm
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.scenario import scenario_from_dict
from pasto.segmented_simulate import simulate_segmented
from pasto.segments import (
    SegmentedConfig,
    joint_exploration,
    initial_segmented_state,
    segment_statistics,
    segmented_update,
    shrinkage,
    shrunk_estimate,
    solve_joint,
)
from pasto.simulate import make_policy, simulate


def _objective(n_guardrails: int, n_arms: int) -> Objective:
    metrics = ["x"] + [f"y{j}" for j in range(n_guardrails)]
    guardrails = [{"metric": f"y{j}", "threshold": 0.0, "hard": True} for j in range(n_guardrails)]
    return Objective.from_spec(metrics, {"primary": "x", "guardrails": guardrails}, [str(k) for k in range(n_arms)])


def _vertex_enumeration(objective, means, shares, scopes):
    """Best value over every basic solution of the joint LP's constraint system (brute force)."""
    n_segments, _, n_arms = means.shape
    n = n_segments * n_arms
    rows, rhs = [], []  # inequalities rows . x >= rhs
    for j, scope in enumerate(scopes):
        guarded = means[:, objective.guardrail_rows[j], :]
        if scope == "global":
            rows.append((shares[:, None] * guarded).ravel())
            rhs.append(0.0)
        else:
            for s in range(n_segments):
                row = np.zeros(n)
                row[s * n_arms:(s + 1) * n_arms] = guarded[s]
                rows.append(row)
                rhs.append(0.0)
    rows += list(np.eye(n))
    rhs += [0.0] * n
    rows, rhs = np.array(rows), np.array(rhs)
    equality = np.zeros((n_segments, n))
    for s in range(n_segments):
        equality[s, s * n_arms:(s + 1) * n_arms] = 1.0
    cost = (shares[:, None] * means[:, 0, :]).ravel()
    best = -np.inf
    for active in itertools.combinations(range(len(rows)), n - n_segments):
        system = np.vstack([equality, rows[list(active)]])
        if abs(np.linalg.det(system)) < 1e-12:
            continue
        x = np.linalg.solve(system, np.concatenate([np.ones(n_segments), rhs[list(active)]]))
        if np.all(rows @ x >= rhs - 1e-9):
            best = max(best, float(cost @ x))
    return best


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_segments=st.integers(1, 3),
    n_arms=st.integers(2, 3),
    n_guardrails=st.integers(0, 2),
    global_scope=st.booleans(),
)
def test_joint_lp_matches_vertex_enumeration(seed, n_segments, n_arms, n_guardrails, global_scope):
    rng = np.random.default_rng(seed)
    objective = _objective(n_guardrails, n_arms)
    means = rng.uniform(-1, 1, size=(n_segments, 1 + n_guardrails, n_arms))
    shares = rng.dirichlet(np.ones(n_segments))
    scopes = ["global" if global_scope else "segment"] * n_guardrails
    brute = _vertex_enumeration(objective, means, shares, scopes)
    solution = solve_joint(objective, means, shares, scopes)
    if np.isfinite(brute):
        assert solution.feasible
        assert solution.value == pytest.approx(brute, abs=1e-7)
    else:
        assert not solution.feasible
    # Simplex invariants per segment, feasible or not.
    assert np.all(solution.probabilities >= 0)
    np.testing.assert_allclose(solution.probabilities.sum(axis=1), 1.0, atol=1e-12)


def test_global_guardrail_shadow_price_is_the_finite_difference():
    objective = _objective(1, 3)
    means = np.array([[[1.0, 0.0, 0.2], [-1.0, 1.0, 0.0]], [[0.0, 1.0, 0.1], [1.0, -1.0, 0.5]]])
    shares = np.array([0.6, 0.4])
    base = solve_joint(objective, means, shares, ["global"])
    relaxed = solve_joint(objective, means, shares, ["global"], thresholds=np.full((2, 1), -1e-4))
    assert base.feasible and base.global_shadow_prices[0] > 0
    assert (relaxed.value - base.value) / 1e-4 == pytest.approx(base.global_shadow_prices[0], rel=1e-6)


def test_infeasible_joint_problem_minimises_the_largest_shortfall():
    objective = _objective(1, 2)
    means = np.array([[[1.0, 0.0], [-2.0, -1.0]], [[0.0, 1.0], [-1.0, -3.0]]])
    solution = solve_joint(objective, means, np.array([0.5, 0.5]), ["global"])
    assert not solution.feasible
    assert solution.largest_shortfall == pytest.approx(1.0)  # both segments on their least bad arm
    assert np.isnan(solution.global_shadow_prices[0])


def test_soft_guardrails_are_refused_with_a_sentence():
    objective = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0, "penalty": 5}]})
    with pytest.raises(ValueError, match="hard guardrails only"):
        solve_joint(objective, np.zeros((2, 2, 2)), np.array([0.5, 0.5]), ["global"])


def _segment_data(rng, true_means, counts, noise=1.0):
    """Statistics (S, M, K) of counts[s, k] observations of N(true_means, noise^2)."""
    segments, arms = [], []
    for s, k in itertools.product(range(counts.shape[0]), range(counts.shape[1])):
        segments += [s] * counts[s, k]
        arms += [k] * counts[s, k]
    segments, arms = np.array(segments), np.array(arms)
    values = true_means[segments, :, arms] + noise * rng.standard_normal((segments.size, true_means.shape[1]))
    return segment_statistics(segments, arms, values, *counts.shape)


def test_shrinkage_vanishes_with_data_and_grows_when_segments_agree():
    rng = np.random.default_rng(0)
    spread_out = rng.normal(0.0, 1.0, size=(20, 1, 2))
    # Unbiased in the limit: with many observations per segment the estimate is the segment's mean.
    large = _segment_data(rng, spread_out, np.full((20, 2), 20_000))
    np.testing.assert_allclose(shrunk_estimate(large).means, spread_out, atol=0.03)
    # Segments that agree (tau small) are pooled harder than segments that differ.
    close = spread_out * 0.01
    small_counts = np.full((20, 2), 50)
    n0_close = shrinkage(_segment_data(rng, close, small_counts)).pseudo_counts
    n0_far = shrinkage(_segment_data(rng, spread_out, small_counts)).pseudo_counts
    assert np.all(n0_close > 10 * n0_far)
    # The posterior mean lies between the segment's sample mean and the pooled mean.
    data = _segment_data(rng, spread_out * 0.3, small_counts)
    raw = data.sums / data.counts
    pooled = data.sums.sum(axis=0) / data.counts.sum(axis=0)
    shrunk = shrunk_estimate(data).means
    assert np.all((shrunk - raw) * (pooled - raw) >= -1e-12)
    assert np.all(np.abs(shrunk - pooled) <= np.abs(raw - pooled) + 1e-12)


def test_shrinkage_reduces_error_for_small_segments():
    rng = np.random.default_rng(1)
    errors_raw, errors_shrunk = [], []
    for _ in range(20):
        truth = rng.normal(0.0, 0.2, size=(30, 1, 3))
        data = _segment_data(rng, truth, np.full((30, 3), 5))
        errors_raw.append(np.mean((shrunk_estimate(data, enabled=False).means - truth) ** 2))
        errors_shrunk.append(np.mean((shrunk_estimate(data).means - truth) ** 2))
    assert np.mean(errors_shrunk) < 0.5 * np.mean(errors_raw)


def test_one_segment_is_exactly_the_unsegmented_controller():
    rng = np.random.default_rng(3)
    objective = _objective(1, 4)
    config = algorithm.AlgorithmConfig()
    segmented_config = SegmentedConfig(algorithm=config, scopes=("global",))
    state = algorithm.initial_state(config, 4, 2, (5,))
    segmented = initial_segmented_state(segmented_config, 1, 4, 2, (5,))
    pooled = Statistics.zeros(2, 4, (5,))
    means = rng.uniform(-1, 1, size=(5, 2, 4))
    for _ in range(30):
        arms = np.array([rng.choice(4, size=8, p=p) for p in state.probabilities])
        values = np.take_along_axis(means, arms[:, None, :], axis=2).swapaxes(1, 2) + rng.standard_normal((5, 8, 2))
        round_stats = Statistics.from_observations(arms, values, 4)
        pooled = pooled + round_stats
        state = algorithm.update(config, objective, state, round_stats, pooled, rng=algorithm.round_generator(1, _))
        as_segment = Statistics(round_stats.counts[:, None], round_stats.sums[:, None], round_stats.sums_of_squares[:, None])
        pooled_segment = Statistics(pooled.counts[:, None], pooled.sums[:, None], pooled.sums_of_squares[:, None])
        segmented = segmented_update(segmented_config, objective, segmented, as_segment, pooled_segment, np.ones(1),
                                     rng=algorithm.round_generator(1, _))
        np.testing.assert_array_equal(segmented.probabilities[:, 0], state.probabilities)
        np.testing.assert_array_equal(segmented.deployed[:, 0], state.deployed)


SCENARIO = {
    "name": "two-arms-one-segment",
    "metrics": ["x", "y"],
    "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
    "arms": {"count": 3, "means": {"uniform": [-1, 1]}},
    "segments": {"names": ["all"], "shares": [1.0], "spread": 0.0},
    "noise": {"kind": "gaussian", "std": 1.0},
    "queries_per_round": 5,
    "rounds": 40,
    "runs": 6,
    "seed": 4,
    "checkpoints": [10, 40],
}


def test_one_segment_simulation_reproduces_the_unsegmented_simulator():
    scenario = scenario_from_dict(json.loads(json.dumps(SCENARIO)))
    unsegmented = simulate(scenario, make_policy("default"))
    segmented = simulate_segmented(scenario, SegmentedConfig(scopes=("global",)))
    for index, checkpoint in enumerate(scenario.checkpoints):
        np.testing.assert_array_equal(segmented.deployed_values[index], unsegmented.deployed_values[checkpoint - 1])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_segments=st.integers(2, 4))
def test_segmented_controller_serves_a_mixture_per_segment(seed, n_segments):
    rng = np.random.default_rng(seed)
    objective = _objective(1, 3)
    config = SegmentedConfig(scopes=("global",))
    shares = rng.dirichlet(np.ones(n_segments))
    state = initial_segmented_state(config, n_segments, 3, 2, (2,))
    pooled = Statistics.zeros(2, 3, (2, n_segments))
    means = rng.uniform(-1, 1, size=(n_segments, 2, 3))
    for t in range(1, 11):  # the joint solve runs at rounds 1, 5 and 10 (solve_every = 5)
        # The last segment never has traffic: it must serve the global mixture.
        segments = rng.choice(n_segments - 1, size=(2, 6))
        arms = rng.choice(3, size=(2, 6))
        values = means[segments, :, arms] + rng.standard_normal((2, 6, 2))
        round_stats = segment_statistics(segments, arms, values, n_segments, 3)
        pooled = pooled + round_stats
        state = segmented_update(config, objective, state, round_stats, pooled, shares, propensities=state.probabilities)
        eps = algorithm.exploration_rate(joint_exploration(config), t + 1)
        assert np.all(state.probabilities >= eps / 3 - 1e-12)
        np.testing.assert_allclose(state.probabilities.sum(axis=-1), 1.0, atol=1e-12)
        np.testing.assert_allclose(state.deployed.sum(axis=-1), 1.0, atol=1e-12)
    platform = pooled.sums.sum(axis=1) / np.maximum(pooled.counts.sum(axis=1), 1)
    from pasto.optimum import solve

    for run in range(2):
        np.testing.assert_allclose(state.joint[run, -1], solve(objective, platform[run]).probabilities, atol=1e-9)


def test_segments_key_round_trips_and_names_bad_input():
    data = json.loads(json.dumps(SCENARIO))
    data["segments"] = {"count": 4, "zipf": 1.0, "spread": 0.2}
    scenario = scenario_from_dict(data)
    np.testing.assert_allclose(scenario.segments.shares, np.array([12, 6, 4, 3]) / 25)
    assert scenario.segments.scopes == ("global",)
    assert scenario_from_dict(scenario.to_dict()) == scenario
    for segments, message in (
        ({"names": ["a"], "count": 1, "shares": [1], "spread": 0}, "exactly one of 'names' and 'count'"),
        ({"names": ["a", "b"], "shares": [1], "spread": 0}, "segments.shares"),
        ({"names": ["a"], "shares": [1], "spread": 0, "scopes": ["nowhere"]}, "segments.scopes"),
        ({"names": ["a"], "shares": [1], "means": [[[0, 1]]]}, "segments"),
    ):
        data["segments"] = segments
        with pytest.raises(ValueError, match=message):
            scenario_from_dict(data)


def test_shrunk_standard_errors_include_the_pooled_means_uncertainty():
    rng = np.random.default_rng(5)
    data = _segment_data(rng, np.zeros((10, 1, 2)), np.full((10, 2), 30))
    estimate = shrunk_estimate(data)
    pooled_error = np.sqrt(shrinkage(data).within_variance / data.counts.sum(axis=0))
    # Segments that agree are pooled completely: as uncertain as the pooled mean, never more certain.
    assert np.all(estimate.standard_errors >= pooled_error[None] * (1 - 1e-9))
    assert np.all(estimate.standard_errors <= shrunk_estimate(data, enabled=False).standard_errors)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_segments=st.integers(1, 4), rounds=st.integers(0, 6),
       estimator=st.sampled_from(["pooled", "ips", "control_variate"]))
def test_segmented_state_and_config_round_trip_through_json(seed, n_segments, rounds, estimator):
    """SegmentedState.to_dict / from_dict after a few updates (every accumulator filled): the JSON text
    round-trips to equal arrays, and the restored state updates to exactly the same next state."""
    from pasto.segments import SegmentedState

    rng = np.random.default_rng(seed)
    objective = _objective(1, 3)
    # Exploration serving, as the service runs segmented experiments (every arm keeps a positive share).
    config = SegmentedConfig(algorithm=algorithm.AlgorithmConfig.from_preset("default", estimator=estimator,
                                                                             serving="exploration"),
                             scopes=("global",), confidence_z=1.5)
    assert SegmentedConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    shares = rng.dirichlet(np.ones(n_segments))
    state = initial_segmented_state(config, n_segments, 3, 2)
    pooled = Statistics.zeros(2, 3, (n_segments,))
    means = rng.uniform(-1, 1, size=(n_segments, 2, 3))

    def one_round(state, pooled):
        segments = rng.choice(n_segments, size=8)
        arms = rng.choice(3, size=8)
        values = means[segments, :, arms] + rng.standard_normal((8, 2))
        round_stats = segment_statistics(segments, arms, values, n_segments, 3)
        pooled = pooled + round_stats
        return segmented_update(config, objective, state, round_stats, pooled, shares), round_stats, pooled

    for _ in range(rounds):
        state, _, pooled = one_round(state, pooled)
    restored = SegmentedState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored.to_dict() == state.to_dict()
    assert restored.n_segments == n_segments
    np.testing.assert_array_equal(restored.joint, state.joint)
    np.testing.assert_array_equal(restored.probabilities, state.probabilities)
    round_stats = segment_statistics(np.zeros(4, dtype=int), np.arange(4) % 3, rng.standard_normal((4, 2)),
                                     n_segments, 3)
    after_original = segmented_update(config, objective, state, round_stats, pooled + round_stats, shares)
    after_restored = segmented_update(config, objective, restored, round_stats, pooled + round_stats, shares)
    assert after_original.to_dict() == after_restored.to_dict()


def test_segmented_state_from_dict_names_what_is_wrong():
    from pasto.segments import SegmentedState

    state = initial_segmented_state(SegmentedConfig(scopes=()), 2, 3, 1).to_dict()
    with pytest.raises(ValueError, match="missing the key"):
        SegmentedState.from_dict({"controller": state["controller"]})
    with pytest.raises(ValueError, match="must agree"):
        SegmentedState.from_dict({**state, "joint": [[1.0, 0.0, 0.0]]})
    with pytest.raises(ValueError, match="unknown key"):
        SegmentedState.from_dict({**state, "extra": 1})


@pytest.mark.parametrize("estimator", ["pooled", "ips", "control_variate"])
def test_added_segments_start_as_copies_of_the_template_and_update(estimator):
    from pasto.segments import add_segments

    rng = np.random.default_rng(0)
    objective = _objective(1, 3)
    config = SegmentedConfig(algorithm=algorithm.AlgorithmConfig.from_preset("default", estimator=estimator),
                             scopes=("global",))
    state = initial_segmented_state(config, 2, 3, 2)
    pooled = Statistics.zeros(2, 3, (2,))
    for _ in range(3):
        stats = segment_statistics(rng.choice(2, 20), rng.choice(3, 20), rng.standard_normal((20, 2)), 2, 3)
        pooled = pooled + stats
        state = segmented_update(config, objective, state, stats, pooled, np.array([0.5, 0.5]))
    grown = add_segments(state, 2, template=0)
    assert grown.n_segments == 4
    for name, value in grown.controller.to_dict().items():
        if isinstance(value, list):
            original = np.asarray(state.controller.to_dict()[name])
            np.testing.assert_array_equal(np.asarray(value)[:2], original)
            np.testing.assert_array_equal(np.asarray(value)[2], original[0])
    assert add_segments(state, 0) is state
    # The grown state updates like any other: the new segments have no data and serve the global mixture.
    pooled = Statistics(*(np.concatenate([a, np.zeros((2, 2, 3))]) for a in (pooled.counts, pooled.sums,
                                                                               pooled.sums_of_squares)))
    stats = segment_statistics(rng.choice(2, 20), rng.choice(3, 20), rng.standard_normal((20, 2)), 4, 3)
    after = segmented_update(config, objective, grown, stats, pooled + stats, np.array([0.4, 0.4, 0.1, 0.1]))
    np.testing.assert_allclose(after.probabilities.sum(axis=-1), 1.0)
    with pytest.raises(ValueError, match="template segment"):
        add_segments(state, 1, template=5)
