"""How an experiment is doing, computed once from the algorithm's current estimate.

:func:`round_report` is what the service's round summaries (stored when a round closes) and its
diagnostics endpoint both need: estimate -> thresholds -> the best mixture and the best single arm
with their values, and for the *served* mixture (the traffic's p, exploration included) and the
*deployed* mixture (what the algorithm recommends) each the estimated objective, the regret against
the best mixture and every guardrail's estimate with its 95% interval
(:func:`pasto.diagnostics.guardrail_report`).

Each mixture also gets its *lift* over the baseline arm (:func:`baseline_lift`): the objective's
``baseline`` (else the first ``relative_to`` arm; a holdout share is served that arm, so its lift is
the lift over the holdout), on the primary metric and on the objective, each with a 95% interval by
the delta method on the per-arm means and standard errors.

Everything is on the estimate, not the truth: the values are what the controller believes now.
Before the experiment has any observation there is no estimate to report: the objective
values, the regret, the best single arm, the guardrail estimates and the lifts are nan (None for the
best single arm and a guardrail's verdicts), never a stand-in's zero (:attr:`RoundReport.has_data`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import math

import numpy as np

from pasto import optimum
from pasto.algorithm import AlgorithmConfig, ControllerState, estimate
from pasto.diagnostics import Z_95, guardrail_report
from pasto.estimators import Estimate, Statistics
from pasto.objectives import Objective

__all__ = [
    "Lift",
    "MixtureReport",
    "Optimum",
    "RoundReport",
    "baseline_lift",
    "round_report",
    "shadow_price_report",
    "solve_optimum",
]


@dataclass(frozen=True)
class Lift:
    """A mixture's value minus the baseline arm's, with a 95% delta-method interval.

    Attributes
    ----------
    estimate : float
        ``g(V p) - g(V e_b)`` for g the primary part (``w . x``) or the objective f.
    lower, upper : float
        ``estimate -+ 1.96 se``; nan while an arm the difference depends on has no standard error.
    relative : float
        ``estimate / g(V e_b)``: the lift as a share of the baseline's value; nan unless that
        value is positive (a share of a negative or zero value means nothing).
    relative_lower, relative_upper : float
        Its 95% interval (delta method on the ratio), nan as ``relative`` or the bounds are.
    """

    estimate: float
    lower: float
    upper: float
    relative: float
    relative_lower: float
    relative_upper: float


def baseline_lift(
    objective: Objective,
    means: np.ndarray,
    standard_errors: np.ndarray,
    thresholds: np.ndarray,
    probabilities: np.ndarray,
    baseline: int,
) -> dict[str, Lift]:
    """Lift of mixture p over the single baseline arm b on the primary metric and on the objective.

    Each arm's and metric's mean is an independent estimate, so for a difference
    ``D(V) = g(V p) - g(V e_b)`` the delta method gives ``Var D = sum_{m,k} (dD/dV_mk)^2 se_mk^2`` with
    ``dD/dV_mk = g'(x_p)_m p_k - g'(x_b)_m [k = b]`` (x_p = V p, x_b = V e_b): the baseline's own
    share of p enters both terms, so the two values' covariance is in. For the relative lift
    ``R = g(V p) / g(V e_b) - 1``, ``dR/dV = (g'(x_p) p^T) / g(x_b) - g(x_p) (g'(x_b) e_b^T) / g(x_b)^2``.
    Resolved relative thresholds are held fixed, as in :meth:`pasto.objectives.Objective.value`; hard
    guardrails take no part in f.

    Parameters
    ----------
    objective : Objective
    means, standard_errors : ndarray, shape (M, K)
    thresholds : ndarray, shape (G,)
        Resolved thresholds (``objective.thresholds(means)``).
    probabilities : ndarray, shape (K,)
    baseline : int
        Column of the baseline arm.

    Returns
    -------
    dict
        ``{"primary": Lift, "objective": Lift}``.
    """
    means = np.asarray(means, dtype=float)
    errors = np.asarray(standard_errors, dtype=float)
    p = np.asarray(probabilities, dtype=float)
    single = np.zeros_like(p)
    single[baseline] = 1.0
    x_mixture, x_baseline = means @ p, means @ single
    weights = objective.primary_weights
    measures = {
        "primary": (float(weights @ x_mixture), float(weights @ x_baseline), weights, weights),
        "objective": (
            float(objective.value(x_mixture, thresholds)),
            float(objective.value(x_baseline, thresholds)),
            objective.gradient(x_mixture, thresholds),
            objective.gradient(x_baseline, thresholds),
        ),
    }
    result = {}
    for name, (value, base, gradient_mixture, gradient_baseline) in measures.items():
        # dg(V p)/dV_mk = g'(x_p)_m p_k; dg(V e_b)/dV_mk = g'(x_b)_m [k = b]: both (M, K).
        mixture_part = np.outer(gradient_mixture, p)
        baseline_part = np.outer(gradient_baseline, single)
        difference = value - base
        spread = _delta_error(mixture_part - baseline_part, errors)
        if base > 0 and np.isfinite(base):
            ratio = difference / base
            ratio_spread = _delta_error(mixture_part / base - value * baseline_part / base**2, errors)
        else:
            ratio = ratio_spread = math.nan
        result[name] = Lift(
            estimate=difference,
            lower=difference - Z_95 * spread,
            upper=difference + Z_95 * spread,
            relative=ratio,
            relative_lower=ratio - Z_95 * ratio_spread,
            relative_upper=ratio + Z_95 * ratio_spread,
        )
    return result


def _delta_error(coefficients: np.ndarray, errors: np.ndarray) -> float:
    """sqrt(sum c_mk^2 se_mk^2) over the entries with c != 0 (an unused arm's missing error is no
    uncertainty); nan when a used entry's error is not finite."""
    used = coefficients != 0
    if not np.all(np.isfinite(errors[used])):
        return math.nan
    return float(np.sqrt(np.sum((coefficients[used] * errors[used]) ** 2)))


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
        ``max(0, f(V p*) - f(V p))`` against the best mixture p* (0 when either value is nan; nan
        without data, :attr:`RoundReport.has_data`).
    guardrails : tuple of dict
        One per guardrail, as :func:`pasto.diagnostics.guardrail_report` gives them: ``metric``,
        ``threshold``, ``relative_to``, ``estimate``, ``interval`` (95%), ``holds``,
        ``confidently_holds``.
    lift : dict or None
        ``{"primary": Lift, "objective": Lift}`` over the baseline arm (:func:`baseline_lift`); None
        when the objective has no baseline arm.
    """

    probabilities: np.ndarray
    value: float
    regret: float
    guardrails: tuple[dict[str, Any], ...]
    lift: dict[str, Lift] | None = None


@dataclass(frozen=True)
class Optimum:
    """The best mixture and the best single arm on one estimate (the expensive part of a report).

    Attributes
    ----------
    best_mixture : ndarray, shape (K,)
        p* = argmax_p f(V p) (:func:`pasto.optimum.best_mixture`).
    best_mixture_value : float
        f(V p*).
    best_single_arm : int
        Index of argmax_k f(V e_k).
    best_single_value : float
        Its value.
    shadow_prices : ndarray, shape (H,), or None
        The best mixture's shadow price of each hard guardrail, in the order of
        ``Objective.hard_indices`` (:attr:`pasto.optimum.Solution.shadow_prices`): objective units
        gained per unit the guardrail's resolved threshold c_j is lowered, >= 0, 0 when it does not
        bind, nan when no mixture meets every hard guardrail. None when the optimum was made without
        them (an ``Optimum`` built by hand or by an older solve): unknown, not zero.
    """

    best_mixture: np.ndarray
    best_mixture_value: float
    best_single_arm: int
    best_single_value: float
    shadow_prices: np.ndarray | None = None


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
    optimum : Optimum
        The best mixture and the best single arm on the estimate; its fields are also read as
        ``best_mixture``, ``best_mixture_value``, ``best_single_arm`` and ``best_single_value``, and
        ``mixing_gain`` is ``best_mixture_value - best_single_value`` (what mixing gains over the best
        single arm).
    served : MixtureReport
        The mixture the traffic was (or is being) served with.
    deployed : MixtureReport
        The mixture the algorithm recommends (``state.deployed``).
    baseline_arm : int or None
        Column of the arm the lifts are measured against (``objective.baseline_index``), or None.
    shadow_prices : tuple of dict
        One per guardrail, in the objective's order (:func:`shadow_price_report` of ``optimum``):
        ``metric``, ``hard`` and ``shadow_price``.
    observed : ndarray of bool, shape (M, K), or None
        Whether each arm has an observation of each metric (pooled counts > 0); where not, the
        estimate's mean is the estimator's stand-in, not a measurement. None: not known (a report
        built by hand), taken as observed.
    """

    round_index: int
    estimate: Estimate
    thresholds: np.ndarray
    optimum: Optimum
    served: MixtureReport
    deployed: MixtureReport
    baseline_arm: int | None = None
    shadow_prices: tuple[dict[str, Any], ...] = ()
    observed: np.ndarray | None = None

    @property
    def has_data(self) -> bool:
        """Whether the experiment has any observation: before that the values are nan and
        :attr:`best_single_arm` is None."""
        return self.observed is None or bool(np.any(self.observed))

    @property
    def best_mixture(self) -> np.ndarray:
        return self.optimum.best_mixture

    @property
    def best_mixture_value(self) -> float:
        return self.optimum.best_mixture_value if self.has_data else math.nan

    @property
    def best_single_arm(self) -> int | None:
        return self.optimum.best_single_arm if self.has_data else None

    @property
    def best_single_value(self) -> float:
        return self.optimum.best_single_value if self.has_data else math.nan

    @property
    def mixing_gain(self) -> float:
        return self.best_mixture_value - self.best_single_value


def solve_optimum(objective: Objective, means: np.ndarray, thresholds: np.ndarray) -> Optimum:
    """:class:`Optimum` of ``objective`` on ``means`` (M, K) with guardrail ``thresholds`` (G,).

    The best mixture is :func:`pasto.optimum.solve` on the point estimates (the hard guardrails'
    constraints on ``means`` too), the solve :func:`pasto.optimum.best_mixture` makes for one
    problem, kept whole so that its shadow prices come along; the best single arm is
    :func:`pasto.optimum.best_single`.
    """
    solution = optimum.solve(objective, means, thresholds)
    best_arm, best_single_value = optimum.best_single(objective, means, thresholds)
    return Optimum(best_mixture=np.asarray(solution.probabilities, dtype=float),
                   best_mixture_value=float(solution.value),
                   best_single_arm=int(best_arm), best_single_value=float(best_single_value),
                   shadow_prices=np.asarray(solution.shadow_prices, dtype=float))


def shadow_price_report(objective: Objective, best: Optimum) -> list[dict[str, Any]]:
    """Each guardrail's shadow price at the best mixture, in the objective's order.

    The shadow price of hard guardrail j is d f(V p*) / d(-c_j): objective units (the primary
    metric's, soft penalties included) gained per unit the resolved threshold c_j is lowered, at the
    best mixture on the point estimates; for a relative guardrail c_j = (1 + r_j) V[g_j, b], so a unit
    is one unit of the guarded metric (lowering r_j by delta lowers c_j by delta V[g_j, b]).

    Returns
    -------
    list of dict
        ``metric``, ``hard`` and ``shadow_price``: >= 0 for a hard guardrail (0 when it does not
        bind), nan for a soft guardrail (its penalty already prices it), for every hard guardrail
        when no mixture meets them all, and when ``best`` has no shadow prices.
    """
    prices = np.full(len(objective.guardrails), np.nan)
    if best.shadow_prices is not None:
        prices[objective.hard_indices] = np.maximum(np.asarray(best.shadow_prices, dtype=float), 0.0)
    return [
        {"metric": guardrail.metric, "hard": bool(guardrail.hard), "shadow_price": float(prices[j])}
        for j, guardrail in enumerate(objective.guardrails)
    ]


def round_report(
    config: AlgorithmConfig,
    objective: Objective,
    state: ControllerState,
    pooled_statistics: Statistics,
    served: np.ndarray | None = None,
    solve: Callable[[Objective, np.ndarray, np.ndarray], Optimum] = solve_optimum,
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
    solve : callable, optional
        ``solve(objective, means (M, K), thresholds (G,)) -> Optimum``; :func:`solve_optimum` by
        default. The service passes one that reuses the optimum of an unchanged estimate.

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
    best = solve(objective, means, thresholds)
    best_value = best.best_mixture_value

    baseline = objective.baseline_index
    observed = np.asarray(pooled_statistics.counts) > 0
    # Without any observation the estimate is only the estimator's stand-ins (zeros or the prior):
    # report no figure rather than one that reads like a measurement.
    has_data = bool(np.any(observed))

    def mixture(probabilities: np.ndarray) -> MixtureReport:
        guardrails = tuple(guardrail_report(objective, current, probabilities))
        if not has_data:
            no_lift = Lift(*([math.nan] * 6))
            return MixtureReport(
                probabilities=probabilities,
                value=math.nan,
                regret=math.nan,
                guardrails=tuple({**entry, "threshold": entry["threshold"] if entry["relative_to"] is None else math.nan,
                                  "estimate": math.nan, "interval": [None, None], "holds": None,
                                  "confidently_holds": None} for entry in guardrails),
                lift=None if baseline is None else {"primary": no_lift, "objective": no_lift},
            )
        value = float(objective.mixture_value(means, probabilities, thresholds))
        lift = None
        if baseline is not None:
            lift = baseline_lift(objective, means, current.standard_errors, thresholds, probabilities, baseline)
        return MixtureReport(
            probabilities=probabilities,
            value=value,
            regret=max(0.0, best_value - value),
            guardrails=guardrails,
            lift=lift,
        )

    return RoundReport(
        round_index=int(state.round_index),
        estimate=current,
        thresholds=np.asarray(thresholds, dtype=float),
        optimum=best,
        served=mixture(served),
        deployed=mixture(np.asarray(state.deployed, dtype=float)),
        baseline_arm=baseline,
        shadow_prices=tuple(shadow_price_report(objective, best)) if has_data else tuple(
            {**entry, "shadow_price": math.nan} for entry in shadow_price_report(objective, best)),
        observed=observed,
    )
