"""bench/learner.py: which runs' gaps the horizon's data can resolve."""

from __future__ import annotations

import numpy as np
import pytest

from pasto.cli import load_scenario
from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("learner") as module:
        yield module


def test_resolvable_z_matches_setup_a_in_closed_form(bench):
    # Oracle: setup A by hand. x = (2, 0), y = (-2, 2), f = x.p - 5 min(0, y.p)^2, so the optimum is
    # p0 = 0.5125 (y.p = -0.05) with f* = 1.0125, against arm 1 alone (f = 0). The gap's gradient in
    # the arms' means: x_k -> p_k - e_k, y_k -> -10 (y.p) p_k = 0.5 p_k; Neyman's split of N draws
    # gives se = sigma sum_k |c_k| / sqrt(N).
    scenario = load_scenario("setup-a")
    means = np.array([[[2.0, 0.0], [-2.0, 2.0]]])
    p = np.array([0.5125, 0.4875])
    c = np.array([[p[0], p[1] - 1.0], 0.5 * p])
    sigma = scenario.noise.std[0]
    expected = 1.0125 / (sigma * np.sqrt((c**2).sum(axis=0)).sum() / np.sqrt(2000.0))
    z = bench.resolvable_z(scenario.objective(), means, scenario.noise, 2000)
    assert z[0] == pytest.approx(expected, rel=1e-4)
    # A quarter of the observations resolve half as many standard errors.
    assert bench.resolvable_z(scenario.objective(), means, scenario.noise, 500)[0] == pytest.approx(expected / 2, rel=1e-4)


def test_resolvable_z_is_undefined_without_a_gap_or_with_hard_guardrails(bench):
    hard = load_scenario("setup-b-hard")
    means = np.random.default_rng(0).uniform(-1.0, 1.0, (2,) + (len(hard.metrics), 10))
    assert np.isnan(bench.resolvable_z(hard.objective(), means, hard.noise, 1000)).all()
    # Setup A with arm 0 holding the guardrail: it is best alone, so there is no gap.
    soft = load_scenario("setup-a")
    assert np.isnan(bench.resolvable_z(soft.objective(), np.array([[[2.0, 0.0], [2.0, 2.0]]]), soft.noise, 2000)).all()
