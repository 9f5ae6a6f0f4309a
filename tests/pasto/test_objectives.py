"""Objective: value, gradient, thresholds and spec validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasto.objectives import Guardrail, Objective

SPEC_A = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]}


@pytest.fixture
def objective_a() -> Objective:
    return Objective.from_spec(["x", "y"], SPEC_A)


def test_penalty_value_matches_formula(objective_a):
    x = np.array([[1.0, -0.5], [2.0, 0.3]])
    values = objective_a.value(x, objective_a.thresholds(np.zeros((2, 1))))
    np.testing.assert_allclose(values, [1.0 - 5.0 * 0.25, 2.0])


def test_linear_objective_without_guardrails():
    objective = Objective.from_spec(["x", "z"], {"primary": {"x": 1.0, "z": 0.5}})
    x = np.array([2.0, 4.0])
    assert objective.value(x, np.zeros(0)) == pytest.approx(4.0)
    np.testing.assert_allclose(objective.gradient(x, np.zeros(0)), [1.0, 0.5])


def test_paper_mixture_beats_both_arms(objective_a):
    # Paper section 3.3: mu_X = [2, 0], mu_Y = [-2, 2], c = 0.
    means = np.array([[2.0, 0.0], [-2.0, 2.0]])
    values = objective_a.mixture_value(means, np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]))
    np.testing.assert_allclose(values, [2.0 - 20.0, 0.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-10, 10), min_size=3, max_size=3),
    st.floats(-3, 3),
    st.floats(-3, 3),
    st.floats(0, 20),
)
def test_gradient_matches_finite_differences(x, c1, c2, penalty):
    objective = Objective.from_spec(
        ["x", "y1", "y2"],
        {
            "primary": "x",
            "guardrails": [
                {"metric": "y1", "threshold": c1, "penalty": penalty},
                {"metric": "y2", "threshold": c2, "penalty": 2.0},
            ],
        },
    )
    x = np.array(x)
    thresholds = np.array([c1, c2])
    h = 1e-6
    numeric = [
        (objective.value(x + h * e, thresholds) - objective.value(x - h * e, thresholds)) / (2 * h)
        for e in np.eye(3)
    ]
    np.testing.assert_allclose(objective.gradient(x, thresholds), numeric, atol=1e-4 * (1 + penalty * 10))


def test_batched_value_and_gradient_match_loop(objective_a):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 2))
    thresholds = rng.normal(size=(4, 3, 1))
    values = objective_a.value(x, thresholds)
    gradients = objective_a.gradient(x, thresholds)
    assert values.shape == (4, 3) and gradients.shape == (4, 3, 2)
    for index in np.ndindex(4, 3):
        assert values[index] == pytest.approx(float(objective_a.value(x[index], thresholds[index])))
        np.testing.assert_allclose(gradients[index], objective_a.gradient(x[index], thresholds[index]))


def test_relative_threshold_resolves_on_baseline_arm():
    objective = Objective.from_spec(
        ["x", "like"],
        {"primary": "x", "guardrails": [
            {"metric": "like", "threshold": -0.02, "penalty": 5.0, "relative_to": "control"}]},
        arm_names=["treatment", "control"],
    )
    means = np.array([[[1.0, 0.5], [0.2, 0.30]], [[1.0, 0.5], [0.2, 0.10]]])
    np.testing.assert_allclose(objective.thresholds(means), [[0.30 * 0.98], [0.10 * 0.98]])


def test_spec_round_trip():
    spec = {
        "primary": {"x": 1.0, "z": 0.5},
        "guardrails": [{"metric": "y", "threshold": -0.02, "penalty": 3.0, "relative_to": "b"}],
    }
    objective = Objective.from_spec(["x", "y", "z"], spec, arm_names=["a", "b"])
    assert objective.to_spec() == spec
    again = Objective.from_spec(["x", "y", "z"], objective.to_spec(), arm_names=["a", "b"])
    assert again == objective
    assert Objective.from_spec(["x", "y"], SPEC_A).to_spec() == SPEC_A


@pytest.mark.parametrize(
    ("spec", "arm_names", "message"),
    [
        ({"primary": "nope"}, None, "Primary metric 'nope'"),
        ({"primary": "x", "guardrails": [{"metric": "q", "threshold": 0, "penalty": 1}]}, None, "unknown metric"),
        ({"primary": "x", "guardrails": [{"metric": "x", "threshold": 0, "penalty": 1}]}, None, "primary"),
        ({"primary": "x", "guardrails": [{"metric": "y", "threshold": 0, "penalty": -1}]}, None, "'penalty'"),
        ({"primary": "x", "guardrails": [{"metric": "y", "threshold": float("nan"), "penalty": 1}]}, None,
         "'threshold' must be finite"),
        ({"primary": "x", "guardrails": [{"metric": "y", "threshold": float("inf"), "penalty": 1}]}, None,
         "'threshold' must be finite"),
        ({"primary": "x", "guardrails": [
            {"metric": "y", "threshold": 0, "penalty": 1, "relative_to": "c"}]}, ["a", "b"], "'relative_to' names arm 'c'"),
        ({"primary": "x", "guardrails": [
            {"metric": "y", "threshold": 0, "penalty": 1, "relative_to": "c"}]}, None, "no arm names"),
        ({"primary": "x", "guardrails": [{"metric": "y", "threshold": 0}]}, None, "'penalty'"),
        ({"primary": "x", "guardrails": [{"metric": "y", "threshold": 0, "penalty": 1, "lambda": 2}]}, None,
         "unknown key"),
        ({"primary": "x", "extra": 1}, None, "unknown key"),
        ({"guardrails": []}, None, "'primary'"),
        ({"primary": {"x": 0.0}}, None, "non-zero"),
        ({"primary": "x", "guardrails": [{"metric": "y", "threshold": "low", "penalty": 1}]}, None, "'threshold'"),
    ],
)
def test_invalid_specs_are_rejected_with_a_sentence(spec, arm_names, message):
    with pytest.raises(ValueError, match=message) as info:
        Objective.from_spec(["x", "y"], spec, arm_names=arm_names)
    assert str(info.value).endswith(".")


def test_duplicate_metric_names_rejected():
    with pytest.raises(ValueError, match="unique"):
        Objective(metrics=("x", "x"), primary=(("x", 1.0),))


def test_guardrail_dataclass_is_frozen():
    guardrail = Guardrail("y", 0.0, 5.0)
    with pytest.raises(AttributeError):
        guardrail.penalty = 1.0  # type: ignore[misc]


# ------------------------------------------------------------------ hard guardrails and the baseline
HARD_SPEC = {
    "primary": "x",
    "guardrails": [
        {"metric": "y", "threshold": 0.06, "hard": True},
        {"metric": "z", "threshold": -0.05, "hard": True, "relative_to": "b"},
        {"metric": "w", "threshold": 0.0, "penalty": 5.0},
    ],
}


def test_hard_guardrail_spec_round_trips_and_has_no_penalty():
    objective = Objective.from_spec(["x", "y", "z", "w"], HARD_SPEC, arm_names=["a", "b"])
    assert [g.hard for g in objective.guardrails] == [True, True, False]
    np.testing.assert_array_equal(objective.penalties, [0.0, 0.0, 5.0])
    np.testing.assert_array_equal(objective.hard_indices, [0, 1])
    np.testing.assert_array_equal(objective.soft_indices, [2])
    assert objective.to_spec() == HARD_SPEC
    assert Objective.from_spec(["x", "y", "z", "w"], objective.to_spec(), arm_names=["a", "b"]) == objective


def test_hard_guardrail_with_a_penalty_is_rejected_with_a_sentence():
    spec = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True, "penalty": 5.0}]}
    with pytest.raises(ValueError, match="either 'hard': true or a 'penalty', not both"):
        Objective.from_spec(["x", "y"], spec)
    with pytest.raises(ValueError, match="missing the required key 'penalty'"):
        Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0}]})
    with pytest.raises(ValueError, match="'hard' must be true or false"):
        Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": 1}]})
    with pytest.raises(ValueError, match="constraint with no penalty"):
        Objective(metrics=("x", "y"), primary=(("x", 1.0),),
                  guardrails=(Guardrail(metric="y", threshold=0.0, penalty=2.0, hard=True),))


def test_value_excludes_hard_guardrails_and_hard_slack_reports_them():
    objective = Objective.from_spec(["x", "y", "z", "w"], HARD_SPEC, arm_names=["a", "b"])
    means = np.array([[1.0, 2.0], [0.05, 0.08], [0.010, 0.020], [-1.0, 1.0]])
    thresholds = objective.thresholds(means)
    # The relative hard threshold is 95% of arm b's share rate, a constant.
    np.testing.assert_allclose(thresholds, [0.06, 0.019, 0.0])
    x = means[:, 0]
    assert objective.value(x, thresholds) == pytest.approx(1.0 - 5.0 * 1.0)
    np.testing.assert_allclose(objective.hard_slack(x, thresholds), [0.05 - 0.06, 0.010 - 0.019])
    np.testing.assert_allclose(objective.hard_slack(means.T, thresholds), [[-0.01, -0.009], [0.02, 0.001]])


def test_baseline_index_named_or_from_relative_to():
    metrics = ["x", "y", "z", "w"]
    assert Objective.from_spec(metrics, HARD_SPEC, arm_names=["a", "b"]).baseline_index == 1
    named = dict(HARD_SPEC, baseline="a")
    objective = Objective.from_spec(metrics, named, arm_names=["a", "b"])
    assert objective.baseline_index == 0 and objective.to_spec()["baseline"] == "a"
    assert Objective.from_spec(["x", "y"], SPEC_A).baseline_index is None
    with pytest.raises(ValueError, match="baseline 'c' is not one of the arms"):
        Objective.from_spec(metrics, dict(HARD_SPEC, baseline="c"), arm_names=["a", "b"])
    with pytest.raises(ValueError, match="no arm names were given"):
        Objective.from_spec(["x", "y"], dict(SPEC_A, baseline="a"))
    with pytest.raises(ValueError, match="'baseline' must be an arm name"):
        Objective.from_spec(["x", "y"], dict(SPEC_A, baseline=3), arm_names=["a"])
