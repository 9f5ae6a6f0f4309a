"""Scenario loading: packaged scenarios by name, files by path, derived scenarios, noise models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pasto.cli import load_scenario, packaged_scenarios
from pasto.scenario import Noise, scenario_from_dict


def minimal(**changes):
    document = {
        "name": "tiny",
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "arms": {"means": [[2.0, 0.0], [-2.0, 2.0]]},
        "noise": {"kind": "gaussian", "std": 1.0},
        "rounds": 50,
    }
    document.update(changes)
    return document


def test_packaged_scenarios_load_by_name():
    assert {"setup-a", "setup-b"} <= set(packaged_scenarios())
    a = load_scenario("setup-a")
    assert a.metrics == ("x", "y")
    assert a.n_arms == 2 and a.queries_per_round == 1
    assert a.rounds == 2000 and a.runs == 1000 and a.checkpoints == (100, 500, 1000, 2000)
    np.testing.assert_allclose(a.noise.std, [math.sqrt(5.0)] * 2)
    assert a.fixed_means
    b = load_scenario("setup-b.json")
    assert b.n_arms == 100 and b.n_metrics == 3 and b.queries_per_round == 10
    assert b.means.uniform == (-1.0, 1.0) and not b.fixed_means


def test_a_path_works_and_means_drift_delay_are_read(tmp_path):
    path = tmp_path / "drifting.json"
    document = minimal(
        drift={"at_round": 20, "means": [[0.0, 2.0], [2.0, -2.0]]},
        delay_rounds=3,
        checkpoints=[10, 50],
        runs=7,
        seed=11,
        description="a drifting problem",
    )
    path.write_text(json.dumps(document))
    scenario = load_scenario(str(path))
    assert scenario.drift.at_round == 20
    np.testing.assert_array_equal(scenario.drift.means.draw(None, 2, 7), [[0.0, 2.0], [2.0, -2.0]])
    assert scenario.delay_rounds == 3 and scenario.runs == 7 and scenario.seed == 11
    assert scenario.checkpoints == (10, 50)
    assert scenario_from_dict(scenario.to_dict()) == scenario


def test_defaults():
    scenario = scenario_from_dict(minimal())
    assert scenario.queries_per_round == 1 and scenario.seed == 0 and scenario.delay_rounds == 0
    assert scenario.checkpoints == (50,) and scenario.drift is None and scenario.description == ""


def test_with_overrides_keeps_checkpoints_within_the_horizon():
    scenario = load_scenario("setup-a").with_overrides(rounds=700, runs=3, seed=5, noise_std=0.5)
    assert scenario.checkpoints == (100, 500, 700)
    assert scenario.runs == 3 and scenario.seed == 5
    assert scenario.noise.std == (0.5, 0.5)
    longer = load_scenario("setup-a").with_overrides(rounds=3000)
    assert longer.checkpoints == (100, 500, 1000, 2000, 3000)


def test_per_metric_noise_std():
    scenario = scenario_from_dict(minimal(noise={"kind": "gaussian", "std": [1.0, 0.0]}))
    noise = scenario.noise.sample(np.random.default_rng(0), (1000, 2))
    assert noise[:, 0].std() > 0.9 and np.all(noise[:, 1] == 0.0)


@pytest.mark.parametrize(
    "noise",
    [
        {"kind": "gaussian", "std": 2.0},
        {"kind": "student_t", "std": 2.0, "df": 5},
        {"kind": "lognormal", "std": 2.0},
    ],
)
def test_noise_kinds_have_mean_zero_and_the_given_std(noise):
    scenario = scenario_from_dict(minimal(noise=noise))
    draws = scenario.noise.sample(np.random.default_rng(1), (400_000, 2))
    assert abs(draws.mean()) < 0.03
    assert draws.std() == pytest.approx(2.0, rel=0.05)


def test_lognormal_noise_is_right_skewed():
    draws = Noise("lognormal", (1.0,)).sample(np.random.default_rng(2), (200_000, 1))
    skewness = np.mean(draws**3) / np.mean(draws**2) ** 1.5
    assert skewness > 3.0


def test_one_additive_kind_observes_its_mean_plus_the_same_draws_as_its_noise():
    # Every scenario written before per-metric kinds keeps its random stream, hence its figures.
    noise = scenario_from_dict(minimal(noise={"kind": "lognormal", "std": [1.0, 0.5]})).noise
    expected = np.random.default_rng(0).uniform(-2.0, 2.0, (50, 3, 2))
    observed = noise.observe(np.random.default_rng(4), expected)
    assert np.array_equal(observed, expected + noise.sample(np.random.default_rng(4), expected.shape))


def test_a_list_of_one_kind_is_that_kind():
    noise = scenario_from_dict(minimal(noise={"kind": ["student_t", "student_t"], "std": 1.0, "df": 4})).noise
    assert noise.kind == "student_t"
    assert scenario_from_dict(minimal(noise={"kind": ["gaussian", "gaussian"], "std": 1.0})).to_dict()["noise"] == \
        {"kind": "gaussian", "std": 1.0}


def test_a_bernoulli_metric_is_a_conversion_of_its_mean_beside_an_additive_one():
    scenario = scenario_from_dict(minimal(
        arms={"means": [[0.02, 0.5], [1.0, 3.0]]},
        noise={"kind": ["bernoulli", "lognormal"], "std": [0.0, 2.0]},
    ))
    assert scenario.to_dict()["noise"] == {"kind": ["bernoulli", "lognormal"], "std": [0.0, 2.0]}
    assert scenario_from_dict(scenario.to_dict()) == scenario
    expected = np.broadcast_to(np.array([[0.02, 1.0], [0.5, 3.0]]), (200_000, 2, 2))
    observed = scenario.noise.observe(np.random.default_rng(3), expected)
    conversions = observed[..., 0]
    assert set(np.unique(conversions)) == {0.0, 1.0}
    for arm, rate in enumerate((0.02, 0.5)):
        # Within 4 standard errors of a Bernoulli(rate) mean over 200,000 draws.
        assert abs(conversions[:, arm].mean() - rate) < 4 * math.sqrt(rate * (1 - rate) / 200_000)
    revenue = observed[..., 1] - expected[..., 1]
    assert revenue.std() == pytest.approx(2.0, rel=0.05) and np.mean(revenue**3) > 0


def test_bernoulli_means_outside_zero_one_are_refused_where_the_file_gives_them():
    bernoulli = {"kind": ["bernoulli", "gaussian"], "std": [0.0, 1.0]}
    with pytest.raises(ValueError, match="arms.means of metric 'x' can be 2, but its noise.kind is bernoulli"):
        scenario_from_dict(minimal(noise=bernoulli))
    grid = {"count": 4, "means": {"knob_grid": {"levels": [2, 2], "base": [0.6, 1.0], "effect": [0.8, 0.1],
                                                "tradeoff": 0.5}}}
    with pytest.raises(ValueError, match="arms.means of metric 'x' can be 1.08"):
        scenario_from_dict(minimal(arms=grid, noise=bernoulli))
    with pytest.raises(ValueError, match="drift.means of metric 'x' can be -0.5"):
        scenario_from_dict(minimal(arms={"means": [[0.1, 0.2], [0.0, 1.0]]}, noise=bernoulli,
                                   drift={"at_round": 10, "means": {"uniform": [-0.5, 0.5]}}))


def test_bernoulli_means_outside_zero_one_are_refused_as_they_are_drawn():
    noise = Noise(("bernoulli", "gaussian"), (0.0, 1.0))
    with pytest.raises(ValueError, match="Metric 0 has noise.kind bernoulli.*one is 2: they must lie in \\[0, 1\\]"):
        noise.observe(np.random.default_rng(0), np.array([[2.0, 0.0]]))
    with pytest.raises(ValueError, match="drawn by Noise.observe"):
        noise.sample(np.random.default_rng(0), (3, 2))


def test_a_conversion_scenario_simulates_with_the_default():
    from pasto.simulate import make_policy, simulate

    scenario = scenario_from_dict(minimal(
        arms={"means": [[0.03, 0.02, 0.025], [0.6, 0.9, 0.8]]},
        objective={"primary": "x", "guardrails": [{"metric": "y", "threshold": -0.05, "relative_to": "1",
                                                    "penalty": 5.0}]},
        noise={"kind": ["bernoulli", "bernoulli"], "std": 0.0}, queries_per_round=200, rounds=20, runs=3,
    ))
    result = simulate(scenario, make_policy("default"))
    assert np.isfinite(result.deployed_values).all() and np.isfinite(result.served_values).all()


def test_uniform_means_are_drawn_per_run():
    scenario = load_scenario("setup-b")
    means = scenario.means.draw(np.random.default_rng(0), scenario.n_metrics, 4)
    assert means.shape == (4, 3, 100)
    assert means.min() >= -1.0 and means.max() <= 1.0
    assert not np.allclose(means[0], means[1])


def test_relative_guardrail_names_an_arm_by_index():
    scenario = scenario_from_dict(
        minimal(objective={"primary": "x", "guardrails": [
            {"metric": "y", "threshold": -0.1, "penalty": 5.0, "relative_to": "1"}]})
    )
    objective = scenario.objective()
    np.testing.assert_allclose(objective.thresholds(np.array([[2.0, 0.0], [-2.0, 2.0]])), [1.8])
