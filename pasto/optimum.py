"""Optimum tools: the best mixture max_p f(mu p) on the simplex, the best single arm, regret.

:func:`mirror_ascent` is the batched exponentiated-gradient solver (entropic mirror ascent with a
per-problem adaptive step and monotone acceptance) that the algorithm's solve-per-round mode
uses. :func:`best_mixture` is exact: mirror ascent finds the support, then SLSQP solves the
problem restricted to a small working set of arms, and columns violating the optimality
condition (``g_k <= p . g`` for every arm, g = mu^T grad f(mu p)) are added until none remains.
Some optimum of f(mu p) uses at most G + 2 arms (f depends on mu p only through the primary
combination and the G guarded rows, a point in R^(G+1); Caratheodory), so the restricted problems
stay small even at K = 10,000.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize
from scipy.special import ndtr

from pasto.objectives import Objective

__all__ = [
    "mirror_ascent",
    "expected_objective",
    "best_mixture",
    "best_single",
    "regret",
    "per_round_regret",
    "smoothness",
]

# Log weights more than this below the largest are clamped: their probability (< e^-700) is zero
# in float64 anyway, and keeping them finite keeps every later step free of inf - inf.
_LOG_WEIGHT_SPAN = 700.0
_LARGEST = np.finfo(float).max
# Largest change of a log weight in one step: beyond a few hundred the outcome is already decided.
_MAX_MOVE = 1e6


def _normalise(log_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log p, p) for unnormalised log weights, sharing one exp (the solver's hot path)."""
    shifted = log_weights - np.max(log_weights, axis=-1, keepdims=True)
    exponentials = np.exp(shifted)
    total = np.sum(exponentials, axis=-1, keepdims=True)
    shifted -= np.log(total)
    exponentials /= total
    return shifted, exponentials


def smoothness(objective: Objective, means: np.ndarray, penalties: np.ndarray | None = None) -> np.ndarray:
    """Upper bound L on the curvature of p -> f(mu p) in the l1 norm; shape (...).

    f's Hessian is diagonal with -2 lambda_j on violated guardrails, so
    |d^T mu^T H mu d| <= 2 sum_j lambda_j max_k mu[g_j, k]^2 for ||d||_1 <= 1. A mirror-ascent step
    of 1 / L never decreases f (relative smoothness with respect to the entropy).
    """
    means = np.asarray(means, dtype=float)
    lam = objective.penalties if penalties is None else np.asarray(penalties, dtype=float)
    rows = means[..., objective.guardrail_rows, :]
    return 2.0 * np.sum(lam * np.max(rows**2, axis=-1), axis=-1)


def _evaluate(objective, means, thresholds, p, penalties):
    x = (means @ p[..., None])[..., 0]
    value = objective.value(x, thresholds, penalties)
    gradient = (objective.gradient(x, thresholds, penalties)[..., None, :] @ means)[..., 0, :]
    return value, gradient


def mirror_ascent(
    objective: Objective,
    means: np.ndarray,
    thresholds: np.ndarray,
    log_weights: np.ndarray | None = None,
    steps: int = 200,
    penalties: np.ndarray | None = None,
    standard_errors: np.ndarray | None = None,
    tolerance: float = 1e-10,
) -> np.ndarray:
    """Maximise f(mu p) over the simplex by exponentiated gradient, for a batch of problems.

    Each problem keeps its own step size: it starts at 1 / L (see :func:`smoothness`), doubles
    after an accepted step and halves after a rejected one; a step is accepted only if f does not
    decrease, so f(mu p) is monotone along the iterations.

    Parameters
    ----------
    objective : Objective
    means : ndarray, shape (..., M, K)
    thresholds : ndarray, shape (..., G)
    log_weights : ndarray, shape (..., K), optional
        Warm start (unnormalised log weights); uniform when omitted.
    steps : int
        Number of iterations (each costs two evaluations of f and its gradient).
    penalties : ndarray, shape (..., G), optional
        Guardrail penalties replacing the objective's.
    standard_errors : ndarray, shape (..., M, K), optional
        When given, maximise the expected objective E f(mu p) with mu ~ N(means, se^2)
        independently per entry (see :func:`expected_objective`) instead of f(means p).
    tolerance : float
        Stop early once every problem's Frank-Wolfe gap max_k g_k - p . g (an upper bound on
        the distance to the optimum) is below ``tolerance * (1 + |f|)``.

    Returns
    -------
    ndarray, shape (..., K)
        Normalised log weights (log p) of the final iterate.
    """
    means = np.asarray(means, dtype=float)
    thresholds = np.asarray(thresholds, dtype=float)
    if log_weights is None:
        log_weights = np.zeros(means.shape[:-2] + means.shape[-1:])
    # Metrics of absurd scale overflow f and its gradient; such problems simply stop moving
    # (non-finite candidates are rejected) instead of producing nan probabilities.
    if standard_errors is None:
        def evaluate(p):
            return _evaluate(objective, means, thresholds, p, penalties)
    else:
        variances = _guardrail_variances(objective, standard_errors)

        def evaluate(p):
            return expected_objective(objective, means, variances, thresholds, p, penalties)

    with np.errstate(over="ignore", invalid="ignore"):
        current, p = _normalise(np.asarray(log_weights, dtype=float))
        value, gradient = evaluate(p)
        gradient = np.nan_to_num(gradient, nan=0.0, posinf=_LARGEST, neginf=-_LARGEST)
        spread = np.ptp(gradient, axis=-1)
        curvature = smoothness(objective, means, penalties)
        # Linear objectives have no curvature: start from a step that moves log-odds by about one.
        step = 1.0 / np.maximum(np.maximum(curvature, spread), 1e-12)
        for _ in range(steps):
            # Frank-Wolfe gap max_k g_k - p . g bounds f* - f(p) for concave f: stop when every
            # problem is solved to the tolerance.
            # Solved problems are frozen, so a problem's iterates do not depend on its batch.
            gap = np.max(gradient, axis=-1) - np.sum(p * gradient, axis=-1)
            active = ~(gap <= tolerance * (1.0 + np.abs(value)))
            if not np.any(active):
                break
            candidate, candidate_p = _normalise(current + _bounded_move(step, gradient))
            candidate_value, candidate_gradient = evaluate(candidate_p)
            accept = active & (candidate_value >= value) & np.all(np.isfinite(candidate), axis=-1)
            current = np.where(accept[..., None], candidate, current)
            p = np.where(accept[..., None], candidate_p, p)
            value = np.where(accept, candidate_value, value)
            if not np.all(np.isfinite(candidate_gradient)):
                candidate_gradient = np.nan_to_num(candidate_gradient, nan=0.0, posinf=_LARGEST, neginf=-_LARGEST)
            gradient = np.where(accept[..., None], candidate_gradient, gradient)
            step = np.where(accept, np.minimum(step * 2.0, 1e12), np.where(active, step * 0.5, step))
    return np.maximum(current, -_LOG_WEIGHT_SPAN)


def _guardrail_variances(objective: Objective, standard_errors: np.ndarray) -> np.ndarray:
    """se^2 of the guarded rows, (..., G, K); an undefined se counts as the row's largest defined one."""
    errors = np.asarray(standard_errors, dtype=float)[..., objective.guardrail_rows, :]
    defined = np.isfinite(errors)
    largest = np.max(np.where(defined, errors, 0.0), axis=-1, keepdims=True)
    return np.where(defined, errors, largest) ** 2


def expected_objective(
    objective: Objective,
    means: np.ndarray,
    variances: np.ndarray,
    thresholds: np.ndarray,
    probabilities: np.ndarray,
    penalties: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """E f(mu p) and its gradient in p when mu ~ N(means, variances) entrywise, independently.

    The primary part is linear, so only the penalties change: for guardrail j,
    Y_j = mu[g_j] . p ~ N(m_j, s_j^2) with s_j^2 = sum_k p_k^2 var[j, k], and with d = m_j - c_j

        E min(0, Y_j - c_j)^2 = (d^2 + s^2) Phi(-d/s) - d s phi(d/s),

    whose derivatives are 2 (d Phi(-d/s) - s phi(d/s)) in d and 2 s Phi(-d/s) in s. The result is
    concave in p (a convex function, nondecreasing in s, of an affine d and a norm s). Deciding on
    E f rather than f(V p) hedges against guardrail estimates that are too optimistic.

    Parameters
    ----------
    objective : Objective
    means : ndarray, shape (..., M, K)
    variances : ndarray, shape (..., G, K)
        Variances of the guarded rows' entries.
    thresholds : ndarray, shape (..., G)
    probabilities : ndarray, shape (..., K)
    penalties : ndarray, shape (..., G), optional

    Returns
    -------
    (ndarray, ndarray)
        Values (...) and gradients (..., K).
    """
    lam = objective.penalties if penalties is None else np.asarray(penalties, dtype=float)
    p = probabilities
    x = (means @ p[..., None])[..., 0]
    d = x[..., objective.guardrail_rows] - thresholds
    s = np.sqrt((variances @ (p**2)[..., None])[..., 0])
    uncertain = s > 1e-300
    safe_s = np.where(uncertain, s, 1.0)
    z = d / safe_s
    tail = ndtr(-z)
    density = np.exp(-0.5 * z**2) / np.sqrt(2.0 * np.pi)
    shortfall = np.minimum(d, 0.0)
    penalty = np.where(uncertain, (d**2 + s**2) * tail - d * s * density, shortfall**2)
    by_d = np.where(uncertain, 2.0 * (d * tail - s * density), 2.0 * shortfall)
    by_s = np.where(uncertain, 2.0 * s * tail, 0.0)
    value = x @ objective.primary_weights - np.sum(lam * penalty, axis=-1)
    # Both gradient terms are matrix-vector products: through the metric rows, and through s.
    weights_x = objective.primary_weights - (lam * by_d) @ objective.guardrail_selector
    gradient = (weights_x[..., None, :] @ means)[..., 0, :]
    gradient = gradient - ((lam * by_s / safe_s)[..., None, :] @ variances)[..., 0, :] * p
    return value, gradient


def _bounded_move(step: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """step * gradient, rescaled per problem so that no entry exceeds _MAX_MOVE (order kept)."""
    scale = np.max(np.abs(gradient), axis=-1)
    scale = np.where(scale > 0, scale, 1.0)
    return (gradient / scale[..., None]) * np.minimum(step * scale, _MAX_MOVE)[..., None]


def _restricted_solve(objective, means, thresholds, support, start):
    sub = means[:, support]

    def negative(q):
        x = sub @ q
        return -float(objective.value(x, thresholds)), -(sub.T @ objective.gradient(x, thresholds))

    result = minimize(
        negative,
        start,
        jac=True,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * len(support),
        constraints=[{"type": "eq", "fun": lambda q: np.sum(q) - 1.0, "jac": lambda q: np.ones_like(q)}],
        options={"ftol": 1e-15, "maxiter": 500},
    )
    q = np.clip(result.x, 0.0, None)
    return q / q.sum()


def _best_mixture_single(objective, means, thresholds):
    m, k = means.shape
    log_p = mirror_ascent(objective, means, thresholds, steps=300)
    p_start = np.exp(log_p)
    best_p, best_value = p_start, float(objective.mixture_value(means, p_start, thresholds))
    single_values = objective.value(means.T, thresholds)
    single = int(np.argmax(single_values))
    if single_values[single] > best_value:
        best_p = np.zeros(k)
        best_p[single] = 1.0
        best_value = float(single_values[single])
    if k == 1:
        return best_p, best_value
    width = min(k, len(objective.guardrails) + 8)
    support = np.union1d(np.argsort(p_start)[-width:], [single])
    p = best_p
    for _ in range(50):
        start = p[support] + 1e-3
        q = _restricted_solve(objective, means, thresholds, support, start / start.sum())
        candidate = np.zeros(k)
        candidate[support] = q
        value = float(objective.mixture_value(means, candidate, thresholds))
        if value >= best_value:
            best_p, best_value = candidate, value
        p = best_p
        x = means @ p
        gradient = means.T @ objective.gradient(x, thresholds)
        gap = gradient - p @ gradient
        scale = 1.0 + np.max(np.abs(gradient))
        outside = np.setdiff1d(np.flatnonzero(gap > 1e-9 * scale), support)
        if outside.size == 0:
            break
        worst = outside[np.argsort(gap[outside])[-width:]]
        support = np.union1d(np.flatnonzero(p > 0), worst)
    # Polish: a few monotone mirror-ascent steps cannot lower the value.
    polished = np.exp(mirror_ascent(objective, means, thresholds, np.log(np.maximum(best_p, 1e-300)), steps=50))
    polished_value = float(objective.mixture_value(means, polished, thresholds))
    if polished_value > best_value:
        best_p, best_value = polished, polished_value
    return best_p, best_value


def best_mixture(
    objective: Objective, means: np.ndarray, thresholds: np.ndarray | None = None
) -> tuple[np.ndarray, float | np.ndarray]:
    """The best mixture p* = argmax_p f(mu p) on the simplex and its value.

    Parameters
    ----------
    objective : Objective
    means : ndarray, shape (..., M, K)
    thresholds : ndarray, shape (..., G), optional
        Defaults to ``objective.thresholds(means)``.

    Returns
    -------
    (ndarray, float or ndarray)
        p* with shape (..., K) and f(mu p*) (a float without batch dimensions, else shape (...)).
    """
    means = np.asarray(means, dtype=float)
    if means.ndim < 2 or means.shape[-2] != objective.n_metrics:
        raise ValueError(f"The means must have shape (..., {objective.n_metrics}, K), got {means.shape}.")
    if not np.all(np.isfinite(means)):
        raise ValueError("The means must be finite.")
    if thresholds is None:
        thresholds = objective.thresholds(means)
    thresholds = np.broadcast_to(np.asarray(thresholds, dtype=float), means.shape[:-2] + (len(objective.guardrails),))
    batch = means.shape[:-2]
    probabilities = np.empty(batch + means.shape[-1:])
    values = np.empty(batch)
    for index in np.ndindex(*batch):
        probabilities[index], values[index] = _best_mixture_single(objective, means[index], thresholds[index])
    if not batch:
        return probabilities, float(values)
    return probabilities, values


def best_single(
    objective: Objective, means: np.ndarray, thresholds: np.ndarray | None = None
) -> tuple[int | np.ndarray, float | np.ndarray]:
    """The best single arm argmax_k f(mu[:, k]) and its value (arrays with batch dimensions)."""
    means = np.asarray(means, dtype=float)
    if thresholds is None:
        thresholds = objective.thresholds(means)
    thresholds = np.asarray(thresholds, dtype=float)
    values = objective.value(np.swapaxes(means, -1, -2), thresholds[..., None, :])
    index = np.argmax(values, axis=-1)
    value = np.take_along_axis(values, index[..., None], axis=-1)[..., 0]
    if index.ndim == 0:
        return int(index), float(value)
    return index, value


def regret(
    objective: Objective, means: np.ndarray, probabilities: np.ndarray, thresholds: np.ndarray | None = None
) -> float | np.ndarray:
    """f(mu p*) - f(mu p): the gap to the best mixture (>= 0 up to solver tolerance)."""
    means = np.asarray(means, dtype=float)
    if thresholds is None:
        thresholds = objective.thresholds(means)
    _, optimum = best_mixture(objective, means, thresholds)
    gap = optimum - objective.mixture_value(means, probabilities, thresholds)
    return float(gap) if np.ndim(gap) == 0 else gap


def per_round_regret(
    objective: Objective,
    means_by_round: np.ndarray,
    probabilities_by_round: np.ndarray,
    estimates_by_round: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The per-round regret terms of the paper's Theorem 2 (mu may drift over rounds).

    With mu_bar_t = (1/t) sum_{s<=t} mu_s, round t contributes
    ``f(mu_bar_t p*_t) - f(mu_bar_t p_t)`` (first bound) and, given the estimates V_s,
    ``f(mu_bar_t p*_t) - f(V_bar_t p_t)`` with V_bar_t = (1/t) sum_{s<=t} V_s (second bound), where
    p*_t maximises f(mu_bar_t p). Thresholds are resolved on mu_bar_t.

    Parameters
    ----------
    means_by_round : ndarray, shape (T, M, K)
    probabilities_by_round : ndarray, shape (T, K)
        p_t served in round t.
    estimates_by_round : ndarray, shape (T, M, K), optional

    Returns
    -------
    dict
        ``regret`` (T,), ``cumulative_regret`` (T,), and with estimates ``empirical_regret`` and
        ``cumulative_empirical_regret``.
    """
    means_by_round = np.asarray(means_by_round, dtype=float)
    probabilities_by_round = np.asarray(probabilities_by_round, dtype=float)
    rounds = np.arange(1, means_by_round.shape[0] + 1)[:, None, None]
    average_means = np.cumsum(means_by_round, axis=0) / rounds
    thresholds = objective.thresholds(average_means)
    optimum = np.empty(means_by_round.shape[0])
    for t in range(means_by_round.shape[0]):
        if t > 0 and np.array_equal(average_means[t], average_means[t - 1]):
            optimum[t] = optimum[t - 1]
        else:
            optimum[t] = best_mixture(objective, average_means[t], thresholds[t])[1]
    achieved = objective.mixture_value(average_means, probabilities_by_round, thresholds)
    result = {"regret": optimum - achieved}
    result["cumulative_regret"] = np.cumsum(result["regret"])
    if estimates_by_round is not None:
        average_estimates = np.cumsum(np.asarray(estimates_by_round, dtype=float), axis=0) / rounds
        empirical = objective.mixture_value(average_estimates, probabilities_by_round, thresholds)
        result["empirical_regret"] = optimum - empirical
        result["cumulative_empirical_regret"] = np.cumsum(result["empirical_regret"])
    return result
