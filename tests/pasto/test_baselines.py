"""Baselines: Thompson sampling converges to one arm, S-SCGD keeps the controller invariants, the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasto.baselines import (
    ScgdConfig,
    ThompsonConfig,
    scgd_initial_state,
    scgd_update,
    thompson_initial_state,
    thompson_update,
)
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.cli import load_scenario
from pasto.scenario import scenario_from_dict
from pasto.simulate import make_policy, round_statistics, simulate

PAPER_A = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]})


def clear_problem(**changes):
    document = {
        "name": "clear",
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "arms": {"means": [[0.0, 0.5, 1.0], [1.0, 1.0, 1.0]]},
        "noise": {"kind": "gaussian", "std": 0.5},
        "queries_per_round": 2,
        "rounds": 200,
        "runs": 40,
        "seed": 1,
        "checkpoints": [200],
    }
    document.update(changes)
    return scenario_from_dict(document)


def test_thompson_converges_to_the_best_arm_on_a_clear_problem():
    result = simulate(clear_problem(), make_policy("thompson"))
    last = result.summary["checkpoints"][-1]
    # The best arm is arm 2 (f = 1) and no mixture beats it, so every run should find it.
    assert result.summary["best_single"] == pytest.approx(1.0)
    assert last["objective"]["median"] == pytest.approx(1.0)
    assert last["objective"]["mean"] > 0.97


def test_thompson_deploys_one_arm_and_stays_below_the_best_mixture_on_setup_a():
    scenario = load_scenario("setup-a").with_overrides(runs=30, rounds=300)
    result = simulate(scenario, make_policy("thompson"))
    final = result.deployed_values[-1]
    # Arm 1 (f = 0) is the best single arm; arm 0 has f = 2 - 5 * 4 = -18.
    assert set(np.round(final, 9)) <= {0.0, -18.0}
    assert np.mean(final == 0.0) > 0.9
    assert result.summary["checkpoints"][-1]["relative_gain"]["median"] == pytest.approx(0.0)


def test_thompson_tries_every_arm_before_trusting_the_posterior():
    config = ThompsonConfig(draws=64)
    rng = np.random.default_rng(0)
    state = thompson_initial_state(config, 4, 2, (3,))
    np.testing.assert_allclose(state.probabilities, 0.25)
    arms = np.array([[0, 0], [1, 1], [2, 3]])
    stats = round_statistics(arms, rng.normal(size=(3, 2, 2)), 4)
    state = thompson_update(config, PAPER_A, state, stats, stats, None, rng)
    # Runs 0 and 1 have three unobserved arms, run 2 two: only those are drawn next.
    assert np.all(state.probabilities[0, 0] == 0.0) and state.probabilities[0, 1:].sum() == pytest.approx(1.0)
    assert np.all(state.probabilities[2, [2, 3]] == 0.0)
    assert state.round_index == 1
    # Deployed is always one arm, among the observed ones.
    assert np.all(state.deployed.sum(axis=-1) == 1.0) and np.all(np.isin(state.deployed, [0.0, 1.0]))
    assert state.deployed[0, 0] == 1.0 and state.deployed[1, 1] == 1.0


def test_thompson_needs_an_rng():
    config = ThompsonConfig()
    state = thompson_initial_state(config, 2, 2)
    stats = Statistics.zeros(2, 2)
    with pytest.raises(ValueError, match="needs an rng"):
        thompson_update(config, PAPER_A, state, stats, stats)


def test_thompson_is_reproducible_by_seed():
    first = simulate(clear_problem(rounds=30, checkpoints=[30]), make_policy("thompson")).to_json()
    second = simulate(clear_problem(rounds=30, checkpoints=[30]), make_policy("thompson")).to_json()
    assert first == second


def test_scgd_runs_on_setup_a_and_reports_the_average_of_served_probabilities():
    scenario = load_scenario("setup-a").with_overrides(runs=50, rounds=200)
    result = simulate(scenario, make_policy("scgd"))
    assert np.isfinite(result.deployed_values).all()
    # f <= the best mixture everywhere; S-SCGD is noisy but must beat the worse arm (f = -18).
    assert np.all(result.deployed_values <= result.summary["best_mixture"] + 1e-9)
    assert result.summary["checkpoints"][-1]["objective"]["mean"] > -5.0


def test_scgd_prefers_the_better_arm_on_a_linear_problem():
    scenario = scenario_from_dict(
        {
            "name": "linear",
            "metrics": ["x"],
            "objective": {"primary": "x"},
            "arms": {"means": [[0.0, 1.0]]},
            "noise": {"kind": "gaussian", "std": 0.1},
            "queries_per_round": 4,
            "rounds": 300,
            "runs": 20,
            "seed": 0,
        }
    )
    result = simulate(scenario, make_policy("scgd", {"step_size": 0.2}))
    assert result.summary["checkpoints"][-1]["objective"]["mean"] > 0.8


@settings(max_examples=25, deadline=None)
@given(st.floats(1e-3, 1e6), st.integers(0, 2**32 - 1))
def test_scgd_probabilities_stay_on_the_simplex_above_the_exploration_floor(scale, seed):
    config = ScgdConfig()
    rng = np.random.default_rng(seed)
    state = scgd_initial_state(config, 3, 2, (4,))
    pooled = Statistics.zeros(2, 3, (4,))
    for _ in range(5):
        arms = rng.integers(0, 3, size=(4, 2))
        stats = round_statistics(arms, scale * rng.normal(size=(4, 2, 2)), 3)
        pooled = pooled + stats
        state = scgd_update(config, PAPER_A, state, stats, pooled)
        floor = config.exploration(state.round_index + 1) / 3
        assert np.all(np.isfinite(state.probabilities))
        np.testing.assert_allclose(state.probabilities.sum(axis=-1), 1.0, atol=1e-12)
        assert np.all(state.probabilities >= floor * (1 - 1e-12))
        np.testing.assert_allclose(state.deployed.sum(axis=-1), 1.0, atol=1e-12)


def test_scgd_skips_a_round_without_observations():
    config = ScgdConfig()
    state = scgd_initial_state(config, 2, 2, (2,))
    empty = Statistics.zeros(2, 2, (2,))
    after = scgd_update(config, PAPER_A, state, empty, empty)
    np.testing.assert_array_equal(after.log_weights, state.log_weights)
    np.testing.assert_array_equal(after.tracked, state.tracked)
    assert after.round_index == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"step_size": -1.0}, "ScgdConfig.step_size must be positive"),
        ({"exploration_scale": 50.0}, "must be at most 1"),
        ({"tracking_exponent": 0.0}, "ScgdConfig.tracking_exponent must be positive"),
    ],
)
def test_scgd_config_validation(changes, message):
    with pytest.raises(ValueError, match=message):
        ScgdConfig(**changes)


def test_configs_round_trip():
    assert ScgdConfig.from_dict(ScgdConfig(step_size=0.3).to_dict()) == ScgdConfig(step_size=0.3)
    assert ThompsonConfig.from_dict(ThompsonConfig(draws=4).to_dict()) == ThompsonConfig(draws=4)
    with pytest.raises(ValueError, match="Unknown ThompsonConfig setting 'samples'"):
        ThompsonConfig.from_dict({"samples": 3})


def test_thompson_scores_each_sampled_arm_like_the_objective():
    from pasto.baselines import _arm_scores

    objective = Objective.from_spec(
        ["a", "b", "y", "z"],
        {
            "primary": {"a": 1.0, "b": -0.5},
            "guardrails": [
                {"metric": "y", "threshold": 0.2, "penalty": 5.0},
                {"metric": "z", "threshold": -0.1, "penalty": 2.0},
            ],
        },
    )
    rng = np.random.default_rng(4)
    samples = rng.normal(size=(3, 5, 4, 6))  # (runs, draws, M, K)
    thresholds = rng.normal(size=(3, 2))
    expected = objective.value(np.swapaxes(samples, -1, -2), thresholds[:, None, None, :])
    np.testing.assert_allclose(_arm_scores(objective, samples, thresholds[:, None, :]), expected, rtol=1e-13, atol=1e-13)
