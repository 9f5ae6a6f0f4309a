"""How an experiment is doing, computed once from the algorithm's current estimate.

:func:`round_report` is what the service's round summaries (stored when a round closes) and its
diagnostics endpoint both need: estimate -> thresholds -> the best mixture and the best single arm
with their values, and for the *served* mixture (the traffic's p, exploration included) and the
*deployed* mixture (what the algorithm recommends) each the estimated objective, the regret against
the best mixture and every guardrail's estimate with its 95% interval
(:func:`pasto.diagnostics.guardrail_report`).

Everything is on the estimate, not the truth: the values are what the controller believes now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pasto import optimum
from pasto.algorithm import AlgorithmConfig, ControllerState, estimate
from pasto.diagnostics import guardrail_report
from pasto.estimators import Estimate, Statistics
from pasto.objectives import Objective

__all__ = ["MixtureReport", "RoundReport", "round_report"]


@dataclass(frozen=True)
class MixtureReport:
    """One mixture under the current estimate.

    Attributes
    ----------
    probabilities : ndarray, shape (K,)
        The mixture p.
    value : float
        Estimated objective f(V p); may be non-finite for absurd metric scales.
    regret : float
        ``max(0, f(V p*) - f(V p))`` against the best mixture p* (0 when either value is nan).
    guardrails : tuple of dict
        One per guardrail, as :func:`pasto.diagnostics.guardrail_report` gives them: ``metric``,
        ``threshold``, ``relative_to``, ``estimate``, ``interval`` (95%), ``holds``,
        ``confidently_holds``.
    """

    probabilities: np.ndarray
    value: float
    regret: float
    guardrails: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class RoundReport:
    """The state of an experiment under the algorithm's current estimate.

    Attributes
    ----------
    round_index : int
        ``state.round_index`` of the state reported on (the round now being served).
    estimate : Estimate
        The algorithm's estimate of the means, shape (M, K) (the estimator of the configuration).
    thresholds : ndarray, shape (G,)
        Guardrail thresholds resolved on the estimate.
    best_mixture : ndarray, shape (K,)
        p* = argmax_p f(V p) (:func:`pasto.optimum.best_mixture`).
    best_mixture_value : float
        f(V p*).
    best_single_arm : int
        Index of argmax_k f(V e_k).
    best_single_value : float
        Its value.
    mixing_gain : float
        ``best_mixture_value - best_single_value``: what mixing gains over the best single arm.
    served : MixtureReport
        The mixture the traffic was (or is being) served with.
    deployed : MixtureReport
        The mixture the algorithm recommends (``state.deployed``).
    """

    round_index: int
    estimate: Estimate
    thresholds: np.ndarray
    best_mixture: np.ndarray
    best_mixture_value: float
    best_single_arm: int
    best_single_value: float
    mixing_gain: float
    served: MixtureReport
    deployed: MixtureReport


def round_report(
    config: AlgorithmConfig,
    objective: Objective,
    state: ControllerState,
    pooled_statistics: Statistics,
    served: np.ndarray | None = None,
) -> RoundReport:
    """Report on an experiment's state under the algorithm's current estimate.

    Parameters
    ----------
    config : AlgorithmConfig
        Chooses the estimator (as :func:`pasto.algorithm.estimate`).
    objective : Objective
    state : ControllerState
        One experiment's state, without batch dimensions (K arms).
    pooled_statistics : Statistics, shape (M, K)
        Observations over every round so far.
    served : ndarray, shape (K,), optional
        The served mixture to report on; defaults to ``state.probabilities`` (the p being served
        now). A round summary written right after round t's update passes the p_t that round t's
        traffic was served with (``state.probabilities`` is then already p_{t+1}).

    Returns
    -------
    RoundReport

    Raises
    ------
    ValueError
        When the state has batch dimensions, or the statistics or the served mixture do not match
        the state's K arms and the objective's M metrics.
    """
    if state.batch_shape:
        raise ValueError(
            f"A round report covers one experiment; the state has batch dimensions {state.batch_shape}."
        )
    n_arms = state.n_arms
    matrix_shape = (objective.n_metrics, n_arms)
    if not isinstance(pooled_statistics, Statistics) or pooled_statistics.shape != matrix_shape:
        shape = getattr(pooled_statistics, "shape", None)
        raise ValueError(f"The pooled statistics must have shape {matrix_shape} (metrics, arms), got {shape}.")
    served = state.probabilities if served is None else np.asarray(served, dtype=float)
    if served.shape != (n_arms,):
        raise ValueError(f"The served mixture must have shape ({n_arms},), got {served.shape}.")
    if not np.all(np.isfinite(served)) or np.any(served < 0):
        raise ValueError("The served mixture must be finite and non-negative.")

    current = estimate(config, state, pooled_statistics)
    means = current.means
    thresholds = objective.thresholds(means)
    best_probabilities, best_value = optimum.best_mixture(objective, means, thresholds)
    best_arm, best_single_value = optimum.best_single(objective, means, thresholds)

    def mixture(probabilities: np.ndarray) -> MixtureReport:
        value = float(objective.mixture_value(means, probabilities, thresholds))
        return MixtureReport(
            probabilities=probabilities,
            value=value,
            regret=max(0.0, best_value - value),
            guardrails=tuple(guardrail_report(objective, current, probabilities)),
        )

    return RoundReport(
        round_index=int(state.round_index),
        estimate=current,
        thresholds=np.asarray(thresholds, dtype=float),
        best_mixture=best_probabilities,
        best_mixture_value=float(best_value),
        best_single_arm=int(best_arm),
        best_single_value=float(best_single_value),
        mixing_gain=float(best_value - best_single_value),
        served=mixture(served),
        deployed=mixture(np.asarray(state.deployed, dtype=float)),
    )
