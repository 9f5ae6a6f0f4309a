"""pasto.report.round_report against values worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pasto.algorithm import AlgorithmConfig, initial_state, update
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.report import Optimum, baseline_lift, round_report, shadow_price_report, solve_optimum

# f(x) = x_0 - 5 min(0, x_1)^2. With p = (q, 1 - q): x = (2q, 2 - 4q); for q > 1/2 the guardrail is
# short by 4q - 2, f = 2q - 5 (4q - 2)^2, maximal at 4q - 2 = 0.05: p* = (0.5125, 0.4875), f = 1.0125.
OBJECTIVE = Objective.from_spec(
    ["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]}
)
MU = np.array([[2.0, 0.0], [-2.0, 2.0]])
Z_95 = 1.959963984540054  # the 97.5% quantile of the standard normal


def _exact_statistics(means: np.ndarray, count: int) -> Statistics:
    """Statistics with sample means ``means`` and sample variance count / (count - 1) per cell."""
    counts = np.full(means.shape, float(count))
    return Statistics(counts, count * means, count * means**2 + counts)


def test_report_of_served_and_deployed_mixtures_by_hand():
    config = AlgorithmConfig.from_preset("default")
    # 101 observations per cell: variance 101/100, standard error sqrt(1.01/101) = 0.1.
    pooled = _exact_statistics(MU, 101)
    state = dataclasses.replace(initial_state(config, 2, 2), deployed=np.array([0.6, 0.4]))
    report = round_report(config, OBJECTIVE, state, pooled)

    assert report.round_index == 0
    np.testing.assert_allclose(report.estimate.means, MU)
    np.testing.assert_allclose(report.estimate.standard_errors, np.full((2, 2), 0.1))
    np.testing.assert_allclose(report.thresholds, [0.0])
    np.testing.assert_allclose(report.best_mixture, [0.5125, 0.4875], atol=1e-6)
    assert report.best_mixture_value == pytest.approx(1.0125, abs=1e-9)
    # Single arms: arm 0 has f = 2 - 5 * 2^2 = -18, arm 1 has f = 0.
    assert report.best_single_arm == 1
    assert report.best_single_value == 0.0
    assert report.mixing_gain == pytest.approx(1.0125, abs=1e-9)

    # Served: the uniform p_1, x = (1, 0), no shortfall.
    np.testing.assert_array_equal(report.served.probabilities, [0.5, 0.5])
    assert report.served.value == pytest.approx(1.0)
    assert report.served.regret == pytest.approx(0.0125, abs=1e-9)
    (served_guardrail,) = report.served.guardrails
    served_se = math.sqrt(0.25 * 0.01 + 0.25 * 0.01)
    assert served_guardrail["metric"] == "y" and served_guardrail["threshold"] == 0.0
    assert served_guardrail["estimate"] == pytest.approx(0.0)
    assert served_guardrail["interval"] == pytest.approx([-Z_95 * served_se, Z_95 * served_se])
    assert served_guardrail["holds"] and not served_guardrail["confidently_holds"]

    # Deployed (0.6, 0.4): x = (1.2, -0.4), f = 1.2 - 5 * 0.16 = 0.4.
    np.testing.assert_array_equal(report.deployed.probabilities, [0.6, 0.4])
    assert report.deployed.value == pytest.approx(0.4)
    assert report.deployed.regret == pytest.approx(0.6125, abs=1e-9)
    (deployed_guardrail,) = report.deployed.guardrails
    deployed_se = math.sqrt(0.36 * 0.01 + 0.16 * 0.01)
    assert deployed_guardrail["estimate"] == pytest.approx(-0.4)
    assert deployed_guardrail["interval"] == pytest.approx([-0.4 - Z_95 * deployed_se, -0.4 + Z_95 * deployed_se])
    assert not deployed_guardrail["holds"] and not deployed_guardrail["confidently_holds"]


def test_served_mixture_can_be_the_closed_rounds_propensities():
    # A summary written after round t's update reports p_t, not the p_{t+1} the state now serves.
    config = AlgorithmConfig.from_preset("default")
    pooled = _exact_statistics(MU, 101)
    state = initial_state(config, 2, 2)
    report = round_report(config, OBJECTIVE, state, pooled, served=np.array([0.5125, 0.4875]))
    assert report.served.value == pytest.approx(1.0125, abs=1e-9)
    assert report.served.regret == pytest.approx(0.0, abs=1e-9)
    assert report.deployed.value == pytest.approx(1.0)  # the uniform initial deployed mixture


def test_report_uses_the_configured_estimator_not_the_pooled_means():
    # Paper preset (IPS, U_0 = 0): one observation (1, 1) on arm 0 served with p = (0.5, 0.5)
    # gives U_1[:, 0] = 1 / 0.5 = 2 and V_1 = (U_0 + U_1) / 2 = [[1, 0], [1, 0]]; pooled means would be
    # [[1, 1], [1, 1]] (the unobserved arm takes the observed arm's mean).
    config = AlgorithmConfig.from_preset("paper")
    state = initial_state(config, 2, 2)
    stats = Statistics.from_observations(np.array([0]), np.array([[1.0, 1.0]]), 2)
    state = update(config, OBJECTIVE, state, stats, stats)
    report = round_report(config, OBJECTIVE, state, stats)
    assert report.round_index == 1
    np.testing.assert_allclose(report.estimate.means, [[1.0, 0.0], [1.0, 0.0]])
    # Arm 0: f = 1; arm 1: f = 0; the mixture (q, 1 - q) has x = (q, q) and f = q, so p* = arm 0.
    assert report.best_single_arm == 0 and report.best_single_value == pytest.approx(1.0)
    assert report.best_mixture_value == pytest.approx(1.0, abs=1e-9)
    assert report.mixing_gain == pytest.approx(0.0, abs=1e-9)
    # Served now: p_2; its value is its share of arm 0.
    assert report.served.value == pytest.approx(state.probabilities[0])


def test_relative_thresholds_are_resolved_on_the_estimate():
    objective = Objective.from_spec(
        ["x", "like"],
        {"primary": "x", "guardrails": [
            {"metric": "like", "threshold": -0.1, "penalty": 1.0, "relative_to": "control"}]},
        arm_names=["control", "treatment"],
    )
    means = np.array([[1.0, 2.0], [0.5, 0.3]])
    config = AlgorithmConfig.from_preset("default")
    report = round_report(config, objective, initial_state(config, 2, 2), _exact_statistics(means, 10))
    # c = 0.5 * (1 - 0.1) = 0.45; the uniform mixture's likes are 0.4.
    np.testing.assert_allclose(report.thresholds, [0.45])
    (guardrail,) = report.served.guardrails
    assert guardrail["threshold"] == pytest.approx(0.45) and guardrail["relative_to"] == "control"
    assert guardrail["estimate"] == pytest.approx(0.4) and not guardrail["holds"]


def test_round_report_rejects_batches_and_mismatched_inputs():
    config = AlgorithmConfig.from_preset("default")
    pooled = _exact_statistics(MU, 5)
    with pytest.raises(ValueError, match="batch dimensions"):
        round_report(config, OBJECTIVE, initial_state(config, 2, 2, (3,)), Statistics.zeros(2, 2, (3,)))
    with pytest.raises(ValueError, match="pooled statistics must have shape"):
        round_report(config, OBJECTIVE, initial_state(config, 2, 2), Statistics.zeros(2, 3))
    with pytest.raises(ValueError, match="served mixture must have shape"):
        round_report(config, OBJECTIVE, initial_state(config, 2, 2), pooled, served=np.ones(3) / 3)
    with pytest.raises(ValueError, match="finite and non-negative"):
        round_report(config, OBJECTIVE, initial_state(config, 2, 2), pooled, served=np.array([1.5, -0.5]))


# ------------------------------------------------------------------------------ lift over the baseline
LIFT_OBJECTIVE = Objective.from_spec(
    ["watch", "likes"],
    {"primary": {"watch": 2.0}, "baseline": "b",
     "guardrails": [{"metric": "likes", "threshold": 0.06, "penalty": 20000.0}]},
    arm_names=["a", "b", "c"],
)


def test_lift_of_the_primary_metric_matches_its_closed_form():
    """Linear in the means, so the delta method is exact: Var = sum_m w_m^2 sum_k (p_k - [k = b])^2 se_mk^2."""
    means = np.array([[5.0, 4.0, 6.0], [0.08, 0.06, 0.02]])
    errors = np.array([[0.1, 0.2, 0.3], [0.01, 0.01, 0.02]])
    p = np.array([0.3, 0.2, 0.5])
    lift = baseline_lift(LIFT_OBJECTIVE, means, errors, LIFT_OBJECTIVE.thresholds(means), p, 1)["primary"]
    difference = 2.0 * (means[0] @ p - means[0, 1])
    spread = 2.0 * math.sqrt(0.3**2 * 0.1**2 + 0.8**2 * 0.2**2 + 0.5**2 * 0.3**2)
    assert lift.estimate == pytest.approx(difference)
    assert (lift.lower, lift.upper) == pytest.approx((difference - Z_95 * spread, difference + Z_95 * spread))
    assert lift.relative == pytest.approx(difference / 8.0)


def test_lift_intervals_cover_the_true_lift_95_percent_of_the_time():
    """Monte-Carlo oracle: estimates drawn around known true means with their standard errors; the
    95% intervals of both lifts (absolute and relative, primary and objective: the penalty is active,
    so the objective's lift is non-linear) must cover the true lift in 95% of draws."""
    rng = np.random.default_rng(7)
    truth = np.array([[5.0, 4.0, 6.0], [0.08, 0.06, 0.03]])
    errors = np.array([[0.05, 0.04, 0.05], [0.002, 0.002, 0.002]])
    p = np.array([0.3, 0.2, 0.5])
    thresholds = LIFT_OBJECTIVE.thresholds(truth)
    true_lift = baseline_lift(LIFT_OBJECTIVE, truth, errors, thresholds, p, 1)
    assert LIFT_OBJECTIVE.value(truth @ p, thresholds) < 2.0 * truth[0] @ p  # the penalty is active
    draws = 4000
    covered = {(measure, kind): 0 for measure in ("primary", "objective") for kind in ("absolute", "relative")}
    for _ in range(draws):
        estimate = truth + errors * rng.standard_normal(truth.shape)
        lift = baseline_lift(LIFT_OBJECTIVE, estimate, errors, thresholds, p, 1)
        for measure in ("primary", "objective"):
            covered[measure, "absolute"] += lift[measure].lower <= true_lift[measure].estimate <= lift[measure].upper
            covered[measure, "relative"] += (lift[measure].relative_lower <= true_lift[measure].relative
                                             <= lift[measure].relative_upper)
    # 4,000 draws: the coverage's standard error is 0.0034; 0.935..0.965 is more than 4 of them.
    for key, count in covered.items():
        assert 0.935 <= count / draws <= 0.965, (key, count / draws)


def test_lift_is_zero_for_the_baseline_itself_and_undefined_without_errors():
    means = np.array([[5.0, 4.0, 6.0], [0.08, 0.06, 0.02]])
    errors = np.array([[0.1, np.inf, 0.3], [0.01, np.inf, 0.02]])
    thresholds = LIFT_OBJECTIVE.thresholds(means)
    lift = baseline_lift(LIFT_OBJECTIVE, means, np.full((2, 3), 0.1), thresholds, np.array([0.0, 1.0, 0.0]), 1)
    assert lift["primary"].estimate == 0.0 and lift["primary"].lower == 0.0 and lift["primary"].upper == 0.0
    # The baseline has no standard error yet: the estimate is defined, the interval is not.
    lift = baseline_lift(LIFT_OBJECTIVE, means, errors, thresholds, np.array([0.5, 0.0, 0.5]), 1)["primary"]
    assert lift.estimate == pytest.approx(2.0 * (5.5 - 4.0))
    assert math.isnan(lift.lower) and math.isnan(lift.upper)
    # An arm without traffic (p_k = 0) adds no uncertainty even without a standard error.
    lift = baseline_lift(LIFT_OBJECTIVE, means, np.where(np.isinf(errors), 0.1, np.inf), thresholds,
                         np.array([0.0, 1.0, 0.0]), 1)["primary"]
    assert lift.lower == 0.0


def test_round_report_gives_lifts_only_with_a_baseline():
    config = AlgorithmConfig.from_preset("default")
    pooled = _exact_statistics(np.array([[5.0, 4.0, 6.0], [0.08, 0.06, 0.02]]), 101)
    state = dataclasses.replace(initial_state(config, 3, 2), deployed=np.array([0.6, 0.0, 0.4]))
    report = round_report(config, LIFT_OBJECTIVE, state, pooled)
    assert report.baseline_arm == 1
    assert report.deployed.lift["primary"].estimate == pytest.approx(2.0 * (0.6 * 5 + 0.4 * 6 - 4.0))
    assert report.served.lift["primary"].estimate == pytest.approx(2.0 * (5.0 - 4.0))
    no_baseline = Objective.from_spec(["watch", "likes"], {"primary": "watch"}, arm_names=["a", "b", "c"])
    report = round_report(config, no_baseline, state, pooled)
    assert report.baseline_arm is None and report.served.lift is None and report.deployed.lift is None


def test_the_optimum_comes_from_the_solve_given():
    """``solve`` is what a report's best mixture, best single arm, mixing gain and regrets are made of
    (the service passes one that reuses an unchanged estimate's optimum)."""
    config = AlgorithmConfig.from_preset("default")
    state = dataclasses.replace(initial_state(config, 2, 2), deployed=np.array([0.6, 0.4]))
    pooled = _exact_statistics(MU, 101)
    seen = []

    def given(objective, means, thresholds):
        seen.append((means.copy(), thresholds.copy()))
        return Optimum(best_mixture=np.array([0.25, 0.75]), best_mixture_value=3.0, best_single_arm=0,
                       best_single_value=2.5)

    report = round_report(config, OBJECTIVE, state, pooled, solve=given)
    (means, thresholds), = seen
    np.testing.assert_allclose(means, MU)
    np.testing.assert_allclose(thresholds, [0.0])
    np.testing.assert_array_equal(report.best_mixture, [0.25, 0.75])
    assert (report.best_mixture_value, report.best_single_arm, report.best_single_value) == (3.0, 0, 2.5)
    assert report.mixing_gain == 0.5
    assert report.served.regret == pytest.approx(3.0 - report.served.value)
    # The default solve is solve_optimum, the best mixture and single arm of pasto.optimum.
    default = round_report(config, OBJECTIVE, state, pooled)
    solved = solve_optimum(OBJECTIVE, MU, np.array([0.0]))
    np.testing.assert_array_equal(default.best_mixture, solved.best_mixture)
    assert (default.best_mixture_value, default.best_single_arm, default.best_single_value) == (
        solved.best_mixture_value, solved.best_single_arm, solved.best_single_value)


def test_shadow_prices_of_the_best_mixture_by_hand():
    """f = x with arms a (x, y) = (2, -2) and b = (-2, 2), hard y >= c: q = p_a <= (2 - c) / 4 and
    f* = 4 q* - 2 = -c, so lowering c by one raises f* by one (shadow price 1). The hard guardrail on z
    (0 on both arms, threshold -5) does not bind: 0. The soft one on w has no shadow price: nan."""
    objective = Objective.from_spec(["x", "y", "z", "w"], {"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 0.0, "hard": True},
        {"metric": "w", "threshold": 0.0, "penalty": 5.0},
        {"metric": "z", "threshold": -5.0, "hard": True}]})
    means = np.array([[2.0, -2.0], [-2.0, 2.0], [0.0, 0.0], [1.0, 1.0]])
    thresholds = objective.thresholds(means)
    best = solve_optimum(objective, means, thresholds)
    np.testing.assert_allclose(best.best_mixture, [0.5, 0.5], atol=1e-12)
    np.testing.assert_allclose(best.shadow_prices, [1.0, 0.0], atol=1e-9)
    report = shadow_price_report(objective, best)
    assert [(item["metric"], item["hard"]) for item in report] == [("y", True), ("w", False), ("z", True)]
    assert report[0]["shadow_price"] == pytest.approx(1.0, abs=1e-9)
    assert math.isnan(report[1]["shadow_price"])
    assert report[2]["shadow_price"] == pytest.approx(0.0, abs=1e-12)
    # round_report carries them (the default solve is solve_optimum).
    config = AlgorithmConfig.from_preset("default")
    state = initial_state(config, 2, 4)
    rounded = round_report(config, objective, state, _exact_statistics(means, 101))
    assert [item["metric"] for item in rounded.shadow_prices] == ["y", "w", "z"]
    assert rounded.shadow_prices[0]["shadow_price"] == pytest.approx(1.0, abs=1e-9)
    # An optimum made without shadow prices (by hand, or cached by an older solve) has them unknown, not 0.
    bare = Optimum(best_mixture=np.array([0.5, 0.5]), best_mixture_value=0.0, best_single_arm=1,
                   best_single_value=-2.0)
    assert all(math.isnan(item["shadow_price"]) for item in shadow_price_report(objective, bare))


def test_shadow_prices_are_nan_when_no_mixture_meets_the_hard_guardrails():
    objective = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 5.0, "hard": True}]})
    means = np.array([[2.0, -2.0], [-2.0, 2.0]])
    best = solve_optimum(objective, means, objective.thresholds(means))
    (item,) = shadow_price_report(objective, best)
    assert item["hard"] is True and math.isnan(item["shadow_price"])
