"""Guardrail report and sample-ratio-mismatch test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pasto.diagnostics import Z_95, guardrail_report, sample_ratio_mismatch
from pasto.estimators import Estimate
from pasto.objectives import Objective

OBJECTIVE = Objective.from_spec(
    ["x", "y"],
    {"primary": "x", "guardrails": [{"metric": "y", "threshold": -0.1, "penalty": 5.0, "relative_to": "b"}]},
    arm_names=["a", "b"],
)


def test_guardrail_report_interval_and_relative_threshold():
    estimate = Estimate(np.array([[1.0, 0.0], [0.8, 1.0]]), np.array([[0.1, 0.1], [0.3, 0.4]]))
    (row,) = guardrail_report(OBJECTIVE, estimate, np.array([0.5, 0.5]))
    se = math.sqrt(0.25 * 0.09 + 0.25 * 0.16)
    assert row["metric"] == "y" and row["relative_to"] == "b"
    assert row["threshold"] == pytest.approx(0.9)
    assert row["estimate"] == pytest.approx(0.9)
    assert row["interval"] == pytest.approx([0.9 - 1.959964 * se, 0.9 + 1.959964 * se], rel=1e-6)
    assert row["holds"] is True and row["confidently_holds"] is False


def test_guardrail_report_without_standard_errors_has_open_interval():
    estimate = Estimate(np.array([[1.0, 0.0], [2.0, 1.0]]), np.full((2, 2), np.nan))
    (row,) = guardrail_report(OBJECTIVE, estimate, np.array([1.0, 0.0]))
    assert row["interval"] == [None, None]
    assert row["holds"] is True and row["confidently_holds"] is False


def test_sample_ratio_mismatch_accepts_matching_and_flags_skew():
    ok = sample_ratio_mismatch(np.array([5000, 3000, 2000]), np.array([0.5, 0.3, 0.2]))
    assert ok["ok"] and ok["statistic"] == pytest.approx(0.0) and ok["p_value"] == pytest.approx(1.0)
    bad = sample_ratio_mismatch(np.array([5400, 2700, 1900]), np.array([0.5, 0.3, 0.2]))
    assert not bad["ok"] and bad["p_value"] < 0.001


def test_sample_ratio_mismatch_edge_cases():
    assert sample_ratio_mismatch(np.zeros(3), np.array([0.2, 0.3, 0.5]))["ok"]
    outright = sample_ratio_mismatch(np.array([10, 1]), np.array([1.0, 0.0]))
    assert outright == {"statistic": None, "p_value": 0.0, "ok": False}
    with pytest.raises(ValueError, match="same length"):
        sample_ratio_mismatch(np.array([1, 2]), np.array([1.0]))


def test_z_95_is_the_normal_quantile_it_writes_out():
    from scipy.special import ndtri

    assert Z_95 == float(ndtri(0.975))
