"""Diagnostics for a running experiment: guardrail estimates with intervals, sample-ratio mismatch."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pasto.estimators import Estimate
from pasto.objectives import Objective

__all__ = ["Z_95", "guardrail_report", "sample_ratio_mismatch"]

#: The 97.5% quantile of the standard normal: half-width of a 95% interval in standard errors.
# ndtri(0.975), written out so that importing this module does not import scipy.special
# (pasto.special); tests/pasto/test_diagnostics.py checks it against scipy.
Z_95 = 1.959963984540054


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def guardrail_report(
    objective: Objective, estimate: Estimate, probabilities: np.ndarray
) -> list[dict[str, Any]]:
    """Estimated guardrail metrics of a mixture, with 95% normal intervals.

    For guardrail j on metric row m the mixture's value is ``y_j = sum_k p_k means[m, k]`` with
    standard error ``sqrt(sum_k p_k^2 se[m, k]^2)`` (arms estimated independently). Relative
    thresholds are resolved on the estimated means; their own uncertainty is not included.

    Parameters
    ----------
    objective : Objective
    estimate : Estimate
        Means and standard errors, shape (M, K) (no batch dimensions).
    probabilities : ndarray, shape (K,)

    Returns
    -------
    list of dict
        One per guardrail: ``metric``, ``threshold`` (resolved c_j), ``relative_to``, ``estimate``,
        ``interval`` [lo, hi] (``None`` entries when a used arm has no standard error yet),
        ``holds`` (point estimate >= threshold) and ``confidently_holds`` (lower end >= threshold).
    """
    means = np.asarray(estimate.means, dtype=float)
    errors = np.asarray(estimate.standard_errors, dtype=float)
    p = np.asarray(probabilities, dtype=float)
    if means.ndim != 2 or means.shape[0] != objective.n_metrics:
        raise ValueError(f"The estimate must have shape ({objective.n_metrics}, K), got {means.shape}.")
    if p.shape != means.shape[-1:]:
        raise ValueError(f"The probabilities must have shape ({means.shape[-1]},), got {p.shape}.")
    thresholds = objective.thresholds(means)
    report = []
    for j, guardrail in enumerate(objective.guardrails):
        row = objective.guardrail_rows[j]
        value = float(means[row] @ p)
        used = p > 0
        standard_error = float(np.sqrt(np.sum((p[used] * errors[row, used]) ** 2)))
        low, high = value - Z_95 * standard_error, value + Z_95 * standard_error
        threshold = float(thresholds[j])
        report.append(
            {
                "metric": guardrail.metric,
                "threshold": threshold,
                "relative_to": guardrail.relative_to,
                "estimate": value,
                "interval": [_finite_or_none(low), _finite_or_none(high)],
                "holds": bool(value >= threshold),
                "confidently_holds": bool(math.isfinite(low) and low >= threshold),
            }
        )
    return report


def sample_ratio_mismatch(
    counts: np.ndarray, expected_probabilities: np.ndarray, alpha: float = 0.001
) -> dict[str, Any]:
    """Chi-square goodness-of-fit test of observed units per arm against logged propensities.

    Parameters
    ----------
    counts : ndarray, shape (K,)
        Units observed per arm.
    expected_probabilities : ndarray, shape (K,)
        The probabilities the units were assigned with (normalised here).
    alpha : float
        Significance level; ``ok`` is ``p_value >= alpha``.

    Returns
    -------
    dict
        ``statistic``, ``p_value``, ``ok``. Arms with probability 0 and no units are left out; a
        unit on an arm with probability 0 is an outright mismatch (statistic inf, p-value 0).
        Without any unit there is nothing to test: statistic and p-value None (no data, not a
        perfect fit), ``ok`` True.
    """
    observed = np.asarray(counts, dtype=float)
    p = np.asarray(expected_probabilities, dtype=float)
    if observed.ndim != 1 or observed.shape != p.shape:
        raise ValueError(
            f"counts and expected_probabilities must be vectors of the same length, got {observed.shape} "
            f"and {p.shape}."
        )
    if np.any(observed < 0) or not np.all(np.isfinite(observed)):
        raise ValueError("counts must be finite and non-negative.")
    if np.any(p < 0) or not np.all(np.isfinite(p)) or p.sum() <= 0:
        raise ValueError("expected_probabilities must be finite, non-negative and not all zero.")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}.")
    total = observed.sum()
    if total == 0:
        return {"statistic": None, "p_value": None, "ok": True}
    if np.any((p == 0) & (observed > 0)):
        return {"statistic": None, "p_value": 0.0, "ok": False}
    keep = p > 0
    if keep.sum() < 2:
        return {"statistic": 0.0, "p_value": 1.0, "ok": True}
    expected = p[keep] / p[keep].sum() * total
    # Imported here, not at the top: scipy.stats costs ~0.5 s of CPU at import, and every process that
    # imports the service (each CLI command, each gunicorn worker) imports this module.
    from scipy import stats

    result = stats.chisquare(observed[keep], expected)
    p_value = float(result.pvalue)
    return {"statistic": float(result.statistic), "p_value": p_value, "ok": bool(p_value >= alpha)}
