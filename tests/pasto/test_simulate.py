"""The vectorised simulator: sampling, statistics, convergence on setup A, seeds, delays and drift."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasto.estimators import Statistics
from pasto.cli import load_scenario
from pasto.scenario import scenario_from_dict
from pasto.simulate import (
    draw_means,
    format_table,
    make_policy,
    reference_values,
    controller_generator,
    round_statistics,
    sample_arms,
    simulate,
    simulation_streams,
)


def small(**changes):
    document = {
        "name": "small",
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "arms": {"means": [[2.0, 0.0], [-2.0, 2.0]]},
        "noise": {"kind": "gaussian", "std": 1.0},
        "queries_per_round": 4,
        "rounds": 120,
        "runs": 20,
        "seed": 3,
        "checkpoints": [40, 120],
    }
    document.update(changes)
    return scenario_from_dict(document)


def recording(policy):
    """The same policy, remembering every update's arguments and result."""
    calls = []

    def step(config, objective, state, round_stats, pooled, propensities, rng):
        new_state = policy.step(config, objective, state, round_stats, pooled, propensities, rng)
        calls.append(
            {"served": state.probabilities, "round": round_stats, "pooled": pooled,
             "propensities": propensities, "state": new_state}
        )
        return new_state

    return dataclasses.replace(policy, step=step), calls


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_sample_arms_stays_in_range_and_skips_zero_probability_arms(runs, n_arms, seed):
    rng = np.random.default_rng(seed)
    probabilities = rng.dirichlet(np.ones(n_arms), size=runs)
    probabilities[:, 0] = 0.0
    if n_arms == 1:
        probabilities[:, 0] = 1.0
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    arms = sample_arms(rng, probabilities, 50)
    assert arms.shape == (runs, 50)
    assert arms.min() >= 0 and arms.max() < n_arms
    assert np.all(probabilities[np.arange(runs)[:, None], arms] > 0)


def test_sample_arms_follows_each_runs_probabilities():
    probabilities = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]])
    arms = sample_arms(np.random.default_rng(0), probabilities, 60_000)
    frequencies = (arms[..., None] == np.arange(3)).mean(axis=1)
    np.testing.assert_allclose(frequencies, probabilities, atol=0.01)


def test_round_statistics_match_per_observation_statistics():
    rng = np.random.default_rng(1)
    arms = rng.integers(0, 4, size=(5, 7))
    values = rng.normal(size=(5, 7, 3))
    mine = round_statistics(arms, values, 4)
    reference = Statistics.from_observations(arms, values, 4)
    for name in ("counts", "sums", "sums_of_squares"):
        np.testing.assert_allclose(getattr(mine, name), getattr(reference, name))


def test_paper_preset_on_setup_a_moves_towards_the_mixture_optimum():
    scenario = load_scenario("setup-a").with_overrides(runs=200, rounds=500)
    result = simulate(scenario, make_policy("paper"))
    summary = result.summary
    assert summary["best_single"] == pytest.approx(0.0)
    assert summary["best_mixture"] == pytest.approx(1.0125, abs=1e-4)
    first, last = summary["checkpoints"]
    assert first["round"] == 100 and last["round"] == 500
    # Reference (ALGORITHM.md): about 0.59 at 100 and 0.83 at 500 over 1000 runs.
    assert 0.45 < first["objective"]["mean"] < 0.75
    assert 0.75 < last["objective"]["mean"] < 0.92
    assert last["relative_gain"]["excluded"] == 0
    assert last["relative_gain"]["median"] == pytest.approx(last["objective"]["median"] / 1.0125, abs=1e-9)
    assert 0 < first["cumulative_regret"]["mean"] < last["cumulative_regret"]["mean"]


def quiet_setup_a(**changes):
    """Setup A with noise sigma 0.5 instead of sqrt(5), and a third arm c (x -1, y -1) that loses on the
    primary and breaks the guardrail: the uniform start is far from the optimum (f -0.22 against 1.0125,
    still at p = (1/2, 1/2, 0)), and the default preset's mechanism shows in 30 rounds of 10 runs. The
    claims on setup A itself, at the paper's noise, need hundreds of runs of 300 rounds (each round an
    exact solve per run): bench/setup_a_claims.py measures them (docs/benchmarks.md)."""
    document = load_scenario("setup-a").with_overrides(runs=10, rounds=30, noise_std=0.5).to_dict()
    document["arms"] = {"means": [[2.0, 0.0, -1.0], [-2.0, 2.0, -1.0]]}
    return scenario_from_dict({**document, **changes})


def test_default_preset_beats_the_paper_preset_on_a_quiet_setup_a():
    # One observation a round: a run whose served share of arm a (0.1-0.3 a round while it is
    # unobserved) never draws it in 30 rounds stays at the start or on arm b (f -0.22 or 0). Measured
    # over seeds 0-39 (400 runs): 6 such runs, the other 394 at f 0.78-1.01, every seed's median f
    # 0.955 or more. A mean over 10 runs fell below 0.9 at 5 of those 40 seeds whenever one run was
    # stuck, so the claim is the median plus at most 2 stuck runs (3 of 10 at a 1.5% rate: 4e-4).
    # Paper: mean f 0.23-0.35 at round 30, cumulative regret 21-25 (seeds 0-2; default 11-18).
    scenario = quiet_setup_a()
    paper = simulate(scenario, make_policy("paper"))
    default = simulate(scenario, make_policy("default"))
    assert default.deployed_values[0].mean() < 0  # the start: a learner that does not move fails below
    last, paper_last = default.summary["checkpoints"][-1], paper.summary["checkpoints"][-1]
    assert last["round"] == 30
    assert last["objective"]["median"] > 0.9
    assert np.sum(default.deployed_values[-1] < 0.5) <= 2
    assert last["objective"]["mean"] > paper_last["objective"]["mean"] + 0.3
    assert last["cumulative_regret"]["mean"] < paper_last["cumulative_regret"]["mean"]


def test_same_seed_same_json_and_another_seed_differs():
    # Four runs: a batch (the simulator's run dimension) of more than one, each with posterior draws.
    scenario = small(rounds=60, runs=4, checkpoints=[40, 60])
    first = simulate(scenario, make_policy("default")).to_json()
    second = simulate(scenario, make_policy("default")).to_json()
    assert first == second
    other = simulate(scenario.with_overrides(seed=4), make_policy("default")).to_json()
    assert other != first
    document = json.loads(first)
    assert document["scenario"] == "small" and document["algorithm"] == "default" and document["runs"] == 4
    assert [row["round"] for row in document["checkpoints"]] == [40, 60]
    assert set(document["checkpoints"][0]["objective"]) == {"mean", "median", "p25", "p75"}
    assert set(document["checkpoints"][0]["relative_gain"]) == {"mean", "median", "p25", "p75", "excluded"}


def test_true_means_depend_on_the_seed_only():
    scenario = load_scenario("setup-b").with_overrides(runs=3)
    first = draw_means(scenario, 3)[0]
    np.testing.assert_array_equal(first, draw_means(scenario.with_overrides(noise_std=1.0), 3)[0])
    assert not np.array_equal(first, draw_means(scenario.with_overrides(seed=1), 3)[0])


def test_every_update_gets_the_round_it_closes_with_its_served_probabilities():
    scenario = small(rounds=30, checkpoints=[30])
    policy, calls = recording(make_policy("paper"))
    simulate(scenario, policy)
    assert len(calls) == 30
    running = np.zeros_like(calls[0]["pooled"].counts)
    for call in calls:
        np.testing.assert_array_equal(call["propensities"], call["served"])
        assert np.all(call["round"].counts.sum(axis=-1) == scenario.queries_per_round)
        running = running + call["round"].counts
        np.testing.assert_array_equal(call["pooled"].counts, running)


def test_what_the_world_draws_does_not_depend_on_what_the_controller_draws():
    # Two controllers serving the same mixtures see the same observations, however many random
    # numbers each draws: paired comparisons of variants stay paired.
    scenario = small(rounds=25, checkpoints=[25])
    plain, plain_calls = recording(make_policy("paper"))
    simulate(scenario, plain)

    def drawing(config, objective, state, round_stats, pooled, propensities, rng):
        rng.random(1 + int(pooled.counts.sum()) % 7)
        return make_policy("paper").step(config, objective, state, round_stats, pooled, propensities, rng)

    drawing_policy, drawing_calls = recording(dataclasses.replace(make_policy("paper"), step=drawing))
    simulate(scenario, drawing_policy)
    for ours, theirs in zip(plain_calls, drawing_calls, strict=True):
        np.testing.assert_array_equal(ours["round"].sums, theirs["round"].sums)
        np.testing.assert_array_equal(ours["state"].probabilities, theirs["state"].probabilities)


def test_the_controller_draws_from_the_services_round_generator():
    scenario = small(rounds=5, checkpoints=[5])
    firsts = []

    def step(config, objective, state, round_stats, pooled, propensities, rng):
        firsts.append(rng.random())
        return make_policy("thompson").step(config, objective, state, round_stats, pooled, propensities, rng)

    simulate(scenario, dataclasses.replace(make_policy("thompson"), step=step))
    _, controller_seed = simulation_streams(scenario.seed)
    assert firsts == [controller_generator(controller_seed, t).random() for t in range(1, 6)]
    assert len(set(firsts)) == 5
    assert controller_seed != simulation_streams(scenario.seed + 1)[1]


def test_delayed_observations_arrive_late_with_the_propensities_they_were_sampled_with():
    delay = 3
    scenario = small(runs=4, rounds=40, checkpoints=[40], delay_rounds=delay)
    policy, calls = recording(make_policy("default"))
    simulate(scenario, policy)
    for index, call in enumerate(calls):
        counts = call["round"].counts
        if index < delay:
            assert counts.sum() == 0.0
        else:
            assert np.all(counts.sum(axis=-1) == scenario.queries_per_round)
            np.testing.assert_array_equal(call["propensities"], calls[index - delay]["served"])
    assert calls[-1]["pooled"].counts.sum() == (40 - delay) * scenario.queries_per_round * 4 * 2


def test_delay_still_converges_on_a_quiet_setup_a():
    # Measured (seeds 0-2): mean f 0.98-1.00 at round 30 with every observation 5 rounds late.
    result = simulate(quiet_setup_a(delay_rounds=5), make_policy("default"))
    assert result.deployed_values[:5].mean() < 0  # no observation yet: still the uniform start
    assert result.summary["checkpoints"][-1]["round"] == 30
    assert result.summary["checkpoints"][-1]["objective"]["mean"] > 0.9


def test_drift_scores_the_deployed_mixture_under_the_means_in_force():
    after = [[0.0, 2.0], [2.0, -2.0]]
    scenario = small(rounds=60, checkpoints=[20, 60], drift={"at_round": 30, "means": after})
    policy, calls = recording(make_policy("paper"))
    result = simulate(scenario, policy)
    objective = scenario.objective()
    before = np.array(scenario.means.fixed)
    for round_number in (29, 30, 60):
        means = before if round_number < 30 else np.array(after)
        expected = objective.mixture_value(means, calls[round_number - 1]["state"].deployed)
        np.testing.assert_allclose(result.deployed_values[round_number - 1], expected)
    summary = result.summary
    assert summary["best_mixture_after_drift"] == pytest.approx(summary["best_mixture"])
    assert "after drift" in format_table(summary)
    # Observations switch with the means: arm 1's x is 0 before and 2 after the drift.
    pooled_before, pooled_after = calls[28]["pooled"], calls[59]["pooled"]
    x_mean_before = pooled_before.sums[:, 0, 1].sum() / pooled_before.counts[:, 0, 1].sum()
    late = (pooled_after.sums[:, 0, 1] - pooled_before.sums[:, 0, 1]).sum() / (
        pooled_after.counts[:, 0, 1] - pooled_before.counts[:, 0, 1]
    ).sum()
    assert abs(x_mean_before) < 0.3 and abs(late - 2.0) < 0.3


def test_drawn_means_report_relative_gain_and_no_fixed_optimum():
    scenario = scenario_from_dict(
        {
            "name": "drawn",
            "metrics": ["x", "y1", "y2"],
            "objective": {"primary": "x", "guardrails": [
                {"metric": "y1", "threshold": 0.5, "penalty": 5.0},
                {"metric": "y2", "threshold": 0.5, "penalty": 5.0}]},
            "arms": {"count": 8, "means": {"uniform": [-1.0, 1.0]}},
            "noise": {"kind": "gaussian", "std": 0.1},
            "queries_per_round": 10,
            # Median relative gain 0.9996-0.9998 at round 60 on seeds 0-2 (0.9996-0.9999 at 120).
            "rounds": 60,
            "runs": 20,
            "seed": 0,
            "checkpoints": [60],
        }
    )
    objective = scenario.objective()
    references = reference_values(objective, draw_means(scenario, 20), 20)
    assert np.all(references.best_mixture >= references.best_single)
    result = simulate(scenario, make_policy("default"), references=references)
    summary = result.summary
    assert "best_mixture" not in summary
    gain = summary["checkpoints"][0]["relative_gain"]
    excluded = int(np.sum(references.best_mixture[0] - references.best_single[0] < 1e-9))
    assert gain["excluded"] == excluded
    assert gain["median"] > 0.8
    assert np.isnan(result.relative_gains[:, references.best_mixture[0] - references.best_single[0] < 1e-9]).all()


@pytest.mark.parametrize("noise", [{"kind": "student_t", "std": 1.0, "df": 3}, {"kind": "lognormal", "std": 1.0}])
def test_heavy_tailed_noise_runs(noise):
    # As many noise draws as 20 runs of 120 rounds of 4 queries (the update's work is per run and
    # round, the draws' per query): 4 runs of 30 rounds of 80.
    result = simulate(small(noise=noise, runs=4, rounds=30, queries_per_round=80, checkpoints=[10, 30]),
                      make_policy("default"))
    assert np.isfinite(result.deployed_values).all()


def test_unknown_algorithm_and_setting():
    with pytest.raises(ValueError, match="Unknown algorithm 'ucb'; choose one of paper, default, scgd, thompson"):
        make_policy("ucb")
    with pytest.raises(ValueError, match="Unknown algorithm setting 'gamma'"):
        make_policy("paper", {"gamma": 0.1})
    policy = make_policy("default", {"serving": "exploration", "deploy": "average"})
    assert policy.config.exploration.deploy == "average"


def test_a_drift_beyond_the_horizon_is_not_reported():
    scenario = small(rounds=120, drift={"at_round": 100, "means": [[0.0, 2.0], [2.0, -2.0]]})
    shortened = scenario.with_overrides(rounds=50)
    summary = simulate(shortened, make_policy("paper")).summary
    assert "best_mixture" in summary and "best_mixture_after_drift" not in summary


def test_references_of_another_scenario_are_refused():
    scenario = small(rounds=10, checkpoints=[10])
    references = reference_values(scenario.objective(), draw_means(scenario, 5), 5)
    with pytest.raises(ValueError, match=r"The references have shape \(1, 5\) but the scenario needs \(1, 20\)"):
        simulate(scenario, make_policy("paper"), references=references)


def _algorithm_1_on_setup_a(runs: int, rounds: int, seed: int) -> np.ndarray:
    """Algorithm 1 on setup A written out directly, over a batch of runs: f(mu p_bar_t), (T, R).

    Independent of pasto.algorithm and pasto.estimators; it reads the simulator's random stream in
    the simulator's order (per round: one uniform per run for the arm, then the noise of both
    metrics), so the same seed gives the same draws.
    """
    mu = np.array([[2.0, 0.0], [-2.0, 2.0]])
    std = 2.2360679775  # setup-a.json: noise variance 5
    _, simulation_seed = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(simulation_seed)
    w = np.ones((runs, 2))
    v = np.zeros((runs, 2, 2))  # U_0 = 0, counted as a round
    p_sum = np.zeros((runs, 2))
    values = np.empty((rounds, runs))
    for t in range(1, rounds + 1):
        eps = 0.1 / np.sqrt(t + 10)
        p = (1 - eps) * w / w.sum(axis=1, keepdims=True) + eps / 2
        u = rng.random((runs, 1))[:, 0]
        arm = (u >= p[:, 0] / p.sum(axis=1)).astype(int)
        observed = mu[:, arm].T + rng.standard_normal((runs, 1, 2))[:, 0, :] * std  # (R, M)
        u_t = np.zeros((runs, 2, 2))
        u_t[np.arange(runs), :, arm] = observed / p[np.arange(runs), arm][:, None]
        v = t / (t + 1) * v + u_t / (t + 1)
        x = np.einsum("rmk,rk->rm", v, p)
        grad_f = np.stack([np.ones(runs), -10.0 * np.minimum(0.0, x[:, 1])], axis=1)
        g = np.einsum("rmk,rm->rk", v, grad_f)
        w = w * np.exp(0.1 / 2 * g)
        w /= w.sum(axis=1, keepdims=True)
        p_sum += p
        deployed_x = (p_sum / t) @ mu.T
        values[t - 1] = deployed_x[:, 0] - 5.0 * np.minimum(0.0, deployed_x[:, 1]) ** 2
    return values


def test_paper_preset_on_setup_a_equals_algorithm_1_written_out_with_the_same_draws():
    # Same draws, so the same runs; but Algorithm 1 amplifies rounding differences (U_t = u / p_t
    # with p_t near eps_t / K): two correct implementations agree to ~1e-14 at round 15 and drift
    # apart by round ~60. So: equal run by run over the first 25 rounds, equal in distribution later.
    scenario = load_scenario("setup-a").with_overrides(runs=2000, rounds=300, seed=11)
    ours = simulate(scenario, make_policy("paper")).deployed_values
    written_out = _algorithm_1_on_setup_a(2000, 300, 11)
    np.testing.assert_allclose(ours[:25], written_out[:25], rtol=1e-9, atol=1e-11)
    for round_number in (100, 300):
        a, b = ours[round_number - 1], written_out[round_number - 1]
        standard_error = np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
        assert abs(a.mean() - b.mean()) < 4 * standard_error, (round_number, a.mean(), b.mean())


def test_deploy_rules_score_the_same_runs_as_separate_simulations():
    scenario = small(runs=12, rounds=60, checkpoints=[20, 60])
    # The deploy rules are those of the exploration path (safe serving deploys what it can defend).
    exploration = {"serving": "exploration"}
    shared = simulate(scenario, make_policy("default", exploration), deploy_rules=("average", "stage", "last")).summary
    for rule in ("average", "stage", "last"):
        alone = simulate(scenario, make_policy("default", {**exploration, "deploy": rule})).summary
        assert shared["deploy_rules"][rule] == alone["checkpoints"]
    assert shared["deploy_rules"]["last"] == shared["checkpoints"]  # the exploration path deploys the last mixture
    with pytest.raises(ValueError, match="deploy_rules applies to the PASTO presets"):
        simulate(scenario, make_policy("scgd"), deploy_rules=("average",))
    with pytest.raises(ValueError, match="Unknown deploy rule 'best'"):
        simulate(scenario, make_policy("default"), deploy_rules=("best",))


def test_every_column_of_the_table_is_labelled_and_explained():
    # The table's layout does not depend on how long the runs are: 3 runs, two checkpoints.
    result = simulate(small(runs=3, rounds=40, checkpoints=[20, 40]), make_policy("default"))
    assert len(result.summary["checkpoints"]) == 2
    lines = format_table(result.summary).splitlines()
    header = next(line for line in lines if line.lstrip().startswith("round"))
    first_row = lines[lines.index(header) + 2]
    assert len(header.replace("|", " ").split()) == len(first_row.replace("|", " ").split()) == 11
    assert "objective f(mu p_hat)" in lines[lines.index(header) - 1] and "relative gain r" in lines[lines.index(header) - 1]
    legend = "\n".join(lines[lines.index(header) + 2 + len(result.summary["checkpoints"]):])
    for label in ("objective:", "relative gain:", "excluded:", "regret:"):
        assert label in legend
    assert "excl." not in header


def test_a_segmented_scenario_is_refused_as_one_population():
    scenario = load_scenario("segments-zipf")
    with pytest.raises(ValueError, match="has segments; simulate it with pasto.segmented_simulate"):
        simulate(scenario, make_policy("default"))
