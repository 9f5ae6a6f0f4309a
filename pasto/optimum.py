"""Optimum tools: the best mixture max_p f(mu p) on the simplex, the best single arm, regret.

:func:`solve` is the exact optimum with soft guardrails (penalties) and hard ones (constraints):
an LP or convex QP proposed by HiGHS and made exact by solving the KKT conditions on its active set,
checked on every arm (see docs/algorithm.md, "Hard and soft guardrails"). :func:`best_mixture`
returns its results for a batch. :func:`mirror_ascent` is the batched exponentiated-gradient solver
(entropic mirror ascent with a per-problem adaptive step and monotone acceptance) that the
algorithm's solve-per-round mode uses for warm-started steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import highspy
import numpy as np

from pasto.objectives import Objective
from pasto.special import ndtr

__all__ = [
    "Solution",
    "solve",
    "ExpectedSolution",
    "expected_optimum",
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

    The primary part is linear, so only the penalties change: for guardrail j, the slack
    S_j = mu[g_j] . p - c_j ~ N(d, s_j^2) with s_j^2 = sum_k (p_k - w_jk)^2 var[j, k] (w the
    threshold's weights, :meth:`pasto.objectives.Objective.threshold_weights`: a relative
    threshold's reference arm is uncertain too), and

        E min(0, S_j)^2 = (d^2 + s^2) Phi(-d/s) - d s phi(d/s),

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
    # The slack's coefficients: p, less a relative threshold's weight on its reference arm.
    coefficients = p[..., None, :] - objective.threshold_weights(p.shape[-1])  # (..., G, K)
    s = np.sqrt(np.sum(variances * coefficients**2, axis=-1))
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
    gradient = gradient - np.sum((lam * by_s / safe_s)[..., :, None] * variances * coefficients, axis=-2)
    return value, gradient


def _bounded_move(step: np.ndarray, gradient: np.ndarray) -> np.ndarray:
    """step * gradient, rescaled per problem so that no entry exceeds _MAX_MOVE (order kept)."""
    scale = np.max(np.abs(gradient), axis=-1)
    scale = np.where(scale > 0, scale, 1.0)
    return (gradient / scale[..., None]) * np.minimum(step * scale, _MAX_MOVE)[..., None]


@dataclass(frozen=True)
class Solution:
    """The exact optimum of one problem (see :func:`solve`).

    Attributes
    ----------
    probabilities : ndarray, shape (K,)
        The optimal mixture p* (on the simplex, at or above the per-arm lower bounds).
    value : float
        ``Objective.value`` at ``means @ p*``: primary plus soft penalties (hard guardrails add nothing).
    feasible : bool
        False when no mixture meets every hard guardrail under ``constraint_means``; then
        ``probabilities`` is the best mixture among those with the smallest largest shortfall.
    shadow_prices : ndarray, shape (H,)
        Per hard guardrail (order of ``Objective.hard_indices``): primary units gained per unit its
        threshold is relaxed (lowered), >= 0 and 0 for a guardrail that does not bind; nan when
        infeasible.
    hard_slack : ndarray, shape (H,)
        y_j - c_j per hard guardrail under ``constraint_means`` (negative when broken).
    largest_shortfall : float
        max_j (c_j - y_j)^+ over the hard guardrails at ``probabilities``: 0 (to solver tolerance)
        when feasible, else the smallest largest shortfall any mixture achieves.
    optimality_gap : float
        An upper bound on (optimum - value) from the Lagrangian dual at the solver's multipliers
        (weak duality; computed from the problem data, not trusted from the solver). About 1e-12
        when the solution is exact; nan when infeasible.
    active_set : tuple of three bool ndarrays, or None
        Where the optimum sits: the arms above their lower bounds (K,), the soft guardrails with a
        penalty that it falls short of (in the order of ``Objective.soft_indices`` with a positive
        penalty), the hard guardrails whose multiplier is positive (H,). :func:`solve` given this
        solution as ``warm_start`` tries it first. None when the optimum was not verified exactly.
    """

    probabilities: np.ndarray
    value: float
    feasible: bool
    shadow_prices: np.ndarray
    hard_slack: np.ndarray
    largest_shortfall: float
    optimality_gap: float
    active_set: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)


def _as_shares(name: str, shares, k: int) -> np.ndarray:
    if shares is None:
        return np.zeros(k)
    shares = np.asarray(shares, dtype=float)
    if shares.shape != (k,):
        raise ValueError(f"{name} must have one entry per arm, shape ({k},), got {shares.shape}.")
    if not np.all(np.isfinite(shares)) or np.any(shares < 0) or np.any(shares > 1):
        raise ValueError(f"{name} must be finite shares between 0 and 1.")
    if shares.sum() > 1.0 + 1e-12:
        raise ValueError(f"{name} sum to {shares.sum():.6g}; shares can sum to at most 1.")
    return shares


class _Problem:
    """max_p a.p - sum_j lam_j (c_j - B_j p)^+^2  s.t.  D_h p >= d_h, sum p = total, p >= lower.

    a = means^T w (K,), B (J, K) the soft guardrails' rows of ``means`` with lam_j > 0, D (H, K) the
    hard guardrails' rows of ``constraint_means``. ``total`` is 1 except for a working set of arms,
    whose complement is held at its lower bounds.
    """

    def __init__(self, a, soft_rows, soft_thresholds, lam, hard_rows, hard_thresholds, lower, total=1.0):
        self.a, self.B, self.c, self.lam = a, soft_rows, soft_thresholds, lam
        self.D, self.d, self.lower, self.total = hard_rows, hard_thresholds, lower, float(total)
        self.k = a.shape[0]
        # Absolute tolerances, relative to the data's scale.
        self.scale = 1.0 + float(np.max(np.abs(a), initial=0.0))
        self.row_scale = 1.0 + max(
            float(np.max(np.abs(soft_rows), initial=0.0)), float(np.max(np.abs(hard_rows), initial=0.0))
        )

    def value(self, p):
        shortfall = np.maximum(self.c - self.B @ p, 0.0)
        return float(self.a @ p - np.sum(self.lam * shortfall**2))

    def scores(self, mu, nu):
        """Gradient of the Lagrangian in p: a + B^T mu + D^T nu, (K,)."""
        return self.a + mu @ self.B + nu @ self.D

    def dual_value(self, mu, nu):
        """The Lagrangian dual at (mu >= 0, nu >= 0): an upper bound on the optimum (weak duality).

        -lam s^2 = min_{mu >= 0} (mu (B p - c) + mu^2 / (4 lam)), so the dual function is
        max_p (a + B^T mu + D^T nu) . p - mu.c - nu.d + sum mu^2 / (4 lam), the max over the
        lower-bounded simplex putting all free mass on the best score.
        """
        scores = self.scores(mu, nu)
        free = self.total - self.lower.sum()
        return float(
            self.lower @ scores + free * np.max(scores) - mu @ self.c - nu @ self.d + np.sum(mu**2 / (4.0 * self.lam))
        )


def _kkt_polish(problem: _Problem, hard_thresholds, free, soft_active, hard_active):
    """Solve the KKT conditions exactly on a guessed active set; (p, mu, nu) or None if they fail.

    Unknowns p_F (free arms), mu (active soft guardrails' multipliers, mu_j = 2 lam_j s_j),
    nu (active hard guardrails'), tau (the simplex's):
        B_AF^T mu + D_HF^T nu - tau = -a_F
        B_jF p_F + mu_j / (2 lam_j)  = c_j - B_j,rest lower_rest     (j active soft)
        D_hF p_F                     = d_h - D_h,rest lower_rest     (h active hard)
        sum p_F                      = 1 - sum lower_rest
    Writing the soft rows with mu (not the shortfall) keeps the system well conditioned at any
    lam. The candidate is accepted only if every KKT condition holds on all K arms.
    """
    lower = problem.lower
    rest = ~free
    nf, na, nh = int(free.sum()), int(soft_active.sum()), int(hard_active.sum())
    B_A, D_H = problem.B[soft_active], problem.D[hard_active]
    n = nf + na + nh + 1
    system = np.zeros((n, n))
    rhs = np.zeros(n)
    system[:nf, nf:nf + na] = B_A[:, free].T
    system[:nf, nf + na:nf + na + nh] = D_H[:, free].T
    system[:nf, -1] = -1.0
    rhs[:nf] = -problem.a[free]
    system[nf:nf + na, :nf] = B_A[:, free]
    system[nf:nf + na, nf:nf + na] = np.diag(1.0 / (2.0 * problem.lam[soft_active]))
    rhs[nf:nf + na] = problem.c[soft_active] - B_A[:, rest] @ lower[rest]
    system[nf + na:nf + na + nh, :nf] = D_H[:, free]
    rhs[nf + na:nf + na + nh] = hard_thresholds[hard_active] - D_H[:, rest] @ lower[rest]
    system[-1, :nf] = 1.0
    rhs[-1] = problem.total - lower[rest].sum()
    try:
        solution = np.linalg.solve(system, rhs)
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(solution)):
        return None
    p = lower.copy()
    p[free] = solution[:nf]
    mu = np.zeros(problem.B.shape[0])
    mu[soft_active] = solution[nf:nf + na]
    nu = np.zeros(problem.D.shape[0])
    nu[hard_active] = solution[nf + na:nf + na + nh]
    tau = solution[-1]
    tolerance = 1e-9
    if np.any(p[free] < lower[free] - tolerance) or np.any(mu < -tolerance * problem.scale):
        return None
    if np.any(nu < -tolerance * problem.scale):
        return None
    row_tolerance = tolerance * problem.row_scale
    if np.any(problem.D @ p < hard_thresholds - row_tolerance):
        return None
    # Inactive soft guardrails must hold (no penalty), active ones must be short by mu / (2 lam).
    soft_gap = problem.B @ p - problem.c
    if np.any(soft_gap[~soft_active] < -row_tolerance):
        return None
    scores = problem.scores(mu, nu)
    if np.any(scores[rest] > tau + tolerance * problem.scale * problem.row_scale):
        return None
    p = np.maximum(p, lower)
    p *= problem.total / p.sum()
    return p, np.maximum(mu, 0.0), np.maximum(nu, 0.0)


class _Coordinates(NamedTuple):
    """A sparse matrix of ``shape`` given by its entries (row, column, value), each (nnz,)."""

    rows: np.ndarray
    columns: np.ndarray
    values: np.ndarray
    shape: tuple[int, int]


def _columns(matrix):
    """(start, index, value) of ``matrix`` in compressed-column form, rows in increasing order within
    a column: what ``scipy.sparse.csc_matrix(matrix)`` stores, built with numpy (scipy.sparse's
    constructors cost more than small solves themselves). A dense matrix keeps its nonzero entries;
    :class:`_Coordinates` every entry given (explicit zeros too), repeated positions summed."""
    if isinstance(matrix, _Coordinates):
        order = np.lexsort((matrix.rows, matrix.columns))
        rows, columns, values = matrix.rows[order], matrix.columns[order], matrix.values[order].astype(float)
        repeated = (rows[1:] == rows[:-1]) & (columns[1:] == columns[:-1])
        if repeated.any():
            first = np.flatnonzero(np.concatenate([[True], ~repeated]))
            rows, columns, values = rows[first], columns[first], np.add.reduceat(values, first)
        start = np.zeros(matrix.shape[1] + 1, dtype=np.int32)
        np.cumsum(np.bincount(columns, minlength=matrix.shape[1]), out=start[1:])
        return start, rows.astype(np.int32), values
    columns = np.asarray(matrix).T
    stored = columns != 0
    start = np.zeros(columns.shape[0] + 1, dtype=np.int32)
    np.cumsum(np.count_nonzero(stored, axis=1), out=start[1:])
    return start, np.nonzero(stored)[1].astype(np.int32), columns[stored].astype(float, copy=False)


def _diagonal_columns(diagonal):
    """:func:`_columns` of the square matrix with this diagonal, (n,), built in O(n)."""
    diagonal = np.asarray(diagonal, dtype=float)
    stored = diagonal != 0
    start = np.zeros(diagonal.shape[0] + 1, dtype=np.int32)
    np.cumsum(stored, out=start[1:])
    return start, np.flatnonzero(stored).astype(np.int32), diagonal[stored]


def _highs(cost, col_lower, col_upper, matrix, row_lower, row_upper, hessian_diagonal=None):
    """Minimise cost.x (+ x^T diag(h) x / 2) s.t. row_lower <= matrix x <= row_upper, col bounds.

    ``hessian_diagonal`` (n,) may be given on a trailing block of columns only (zeros elsewhere).
    Returns (model status, x, row duals).
    """
    start, index, value = _columns(matrix)
    lp = highspy.HighsLp()
    lp.num_col_ = matrix.shape[1]
    lp.num_row_ = matrix.shape[0]
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_ = np.asarray(col_lower, dtype=float)
    lp.col_upper_ = np.asarray(col_upper, dtype=float)
    lp.row_lower_ = np.asarray(row_lower, dtype=float)
    lp.row_upper_ = np.asarray(row_upper, dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start
    lp.a_matrix_.index_ = index
    lp.a_matrix_.value_ = value
    model = highspy.HighsModel()
    model.lp_ = lp
    if hessian_diagonal is not None and np.any(hessian_diagonal):
        hessian = highspy.HighsHessian()
        hessian.dim_ = matrix.shape[1]
        hessian.format_ = highspy.HessianFormat.kTriangular
        hessian.start_, hessian.index_, hessian.value_ = _diagonal_columns(hessian_diagonal)
        model.hessian_ = hessian
    # The bare C++ class (exported as ``highspy._Highs``): the ``Highs`` wrapper installs Python
    # callbacks, which cost time per instance and print HiGHS's banner on stdout (past sys.stdout,
    # corrupting the CLI's JSON output).
    highs = highspy._Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("threads", 1)
    # HiGHS's QP solver can stall for a long time (with lam in its Hessian it did at K = 100); it
    # then reports an iteration limit and the cutting-plane LPs take over. The limit counts
    # iterations, not seconds, so that a result does not depend on the machine's load (a 1 s time
    # limit made batched and per-run updates differ on a busy machine); the time limit is a net.
    if hessian_diagonal is not None:
        highs.setOptionValue("qp_iteration_limit", 10 * (matrix.shape[0] + matrix.shape[1]) + 1000)
    highs.setOptionValue("time_limit", 60.0)
    highs.passModel(model)
    highs.run()
    solution = highs.getSolution()
    return (
        highs.getModelStatus(),
        np.asarray(solution.col_value, dtype=float),
        np.asarray(solution.row_dual, dtype=float),
    )


def linear_program(cost, upper_rows=None, upper_bounds=None, equality_rows=None, equality_bounds=None,
                   lower=None, upper=None):
    """min cost . x  s.t.  upper_rows x <= upper_bounds, equality_rows x = equality_bounds, lower <= x <= upper.

    The one LP entry point of the package (HiGHS), for problems whose rows are not an objective's
    guardrails (:func:`solve` is the entry point for those): pessimistic serving rows, the joint
    problem of several segments.

    Parameters
    ----------
    cost : ndarray, shape (n,)
    upper_rows : ndarray, shape (u, n), optional
    upper_bounds : ndarray, shape (u,), optional
    equality_rows : ndarray, shape (e, n), optional
    equality_bounds : ndarray, shape (e,), optional
    lower, upper : ndarray, shape (n,), optional
        Column bounds; 0 and +inf by default (nan or inf entries mean unbounded).

    Returns
    -------
    (bool, ndarray, ndarray)
        Whether an optimum was found, x (n,), and d(min cost)/d(upper_bounds) (u,), <= 0.
    """
    cost = np.asarray(cost, dtype=float)
    n = cost.shape[0]
    upper_rows = np.zeros((0, n)) if upper_rows is None else np.asarray(upper_rows, dtype=float).reshape(-1, n)
    upper_bounds = np.zeros(0) if upper_bounds is None else np.asarray(upper_bounds, dtype=float)
    equality_rows = np.zeros((0, n)) if equality_rows is None else np.asarray(equality_rows, dtype=float).reshape(-1, n)
    equality_bounds = np.zeros(0) if equality_bounds is None else np.asarray(equality_bounds, dtype=float)
    lower = np.zeros(n) if lower is None else np.where(np.isnan(lower), -_INFINITY, np.asarray(lower, dtype=float))
    upper = np.full(n, _INFINITY) if upper is None else np.where(np.isnan(upper), _INFINITY,
                                                                 np.asarray(upper, dtype=float))
    lower = np.where(np.isneginf(lower), -_INFINITY, lower)
    upper = np.where(np.isposinf(upper), _INFINITY, upper)
    matrix = np.vstack([upper_rows, equality_rows])
    row_lower = np.concatenate([np.full(upper_bounds.shape, -_INFINITY), equality_bounds])
    row_upper = np.concatenate([upper_bounds, equality_bounds])
    status, x, duals = _highs(cost, lower, upper, matrix, row_lower, row_upper)
    return status == _OPTIMAL, x, duals[: upper_bounds.shape[0]]


_INFINITY = highspy.kHighsInf
_OPTIMAL = highspy.HighsModelStatus.kOptimal
_INFEASIBLE = highspy.HighsModelStatus.kInfeasible


def _base_rows(problem: _Problem, hard_thresholds: np.ndarray, extra_columns: int):
    """Rows shared by every formulation: hard guardrails then the simplex, (H + 1, K + extra)."""
    h = problem.D.shape[0]
    matrix = np.vstack([problem.D, np.ones((1, problem.k))])
    matrix = np.hstack([matrix, np.zeros((h + 1, extra_columns))])
    total = [problem.total]
    return matrix, np.concatenate([hard_thresholds, total]), np.concatenate([np.full(h, _INFINITY), total])


def _largest_shortfall_margin(problem: _Problem, hard_thresholds: np.ndarray) -> float:
    """max_p min_h (D_h p - d_h) over the lower-bounded simplex (an LP): minus the smallest largest shortfall."""
    k, h = problem.k, problem.D.shape[0]
    matrix, row_lower, row_upper = _base_rows(problem, hard_thresholds, 1)
    matrix[:h, -1] = -1.0
    cost = np.concatenate([np.zeros(k), [-1.0]])
    status, x, _ = _highs(
        cost, np.concatenate([problem.lower, [-_INFINITY]]), np.concatenate([np.ones(k), [_INFINITY]]),
        matrix, row_lower, row_upper,
    )
    if status != _OPTIMAL:
        raise RuntimeError(f"HiGHS did not solve the largest-shortfall problem (model status {status.name}).")
    return float(x[-1])


def _candidates(problem: _Problem, hard_thresholds: np.ndarray):
    """Approximate solutions (p, soft shortfalls, mu, nu) from HiGHS, best guess first; None if infeasible.

    1. The convex QP itself, a soft guardrail's shortfall written u_j / sqrt(2 lam_j) so that its
       penalty is u_j^2 / 2 (a unit Hessian; lam up to 1e9 in the Hessian stalls HiGHS). HiGHS's
       QP solver is not dependable at large lam (it can even report the problem unbounded), so:
    2. Linear programs where each soft penalty is replaced by its tangents (a cutting-plane outer
       approximation, Kelley's method), new tangents at the last shortfalls each round. Its active
       set settles on the QP's after a few rounds; every candidate is checked exactly by the caller.
    """
    k, j, h = problem.k, problem.B.shape[0], problem.D.shape[0]
    base, base_lower, base_upper = _base_rows(problem, hard_thresholds, j)
    if j:
        root = np.sqrt(2.0 * problem.lam)
        soft = np.hstack([problem.B, np.diag(1.0 / root)])
        status, x, duals = _highs(
            np.concatenate([-problem.a, np.zeros(j)]),
            np.concatenate([problem.lower, np.zeros(j)]),
            np.concatenate([np.ones(k), np.full(j, _INFINITY)]),
            np.vstack([soft, base]),
            np.concatenate([problem.c, base_lower]),
            np.concatenate([np.full(j, _INFINITY), base_upper]),
            hessian_diagonal=np.concatenate([np.zeros(k), np.ones(j)]),
        )
        if status == _INFEASIBLE:
            yield None
            return
        if status == _OPTIMAL:
            yield x[:k], x[k:] / root, duals[:j], duals[j:j + h]
    # Kelley: columns p (K), u (J), t (J), the shortfall s_j = u_j / sqrt(2 lam_j) as above;
    # maximise a.p - sum t with t_j >= u0 u_j - u0^2 / 2 for every tangent point u0 so far (u0 = 0
    # gives t_j >= 0). In u the cuts' coefficients stay moderate at any lam.
    root = np.sqrt(2.0 * problem.lam)
    tangents = [[0.0] for _ in range(j)]
    for _ in range(60):
        cuts = [(row, s0) for row in range(j) for s0 in tangents[row]]
        n = k + 2 * j
        soft = np.zeros((j, n))
        soft[:, :k] = problem.B
        soft[:, k:k + j] = np.diag(1.0 / root)
        cut_rows = np.zeros((len(cuts), n))
        cut_lower = np.zeros(len(cuts))
        for position, (row, u0) in enumerate(cuts):
            cut_rows[position, k + j + row] = 1.0
            cut_rows[position, k + row] = -u0
            cut_lower[position] = -0.5 * u0**2
        matrix = np.vstack([soft, np.hstack([base, np.zeros((h + 1, j))]), cut_rows])
        status, x, duals = _highs(
            np.concatenate([-problem.a, np.zeros(j), np.ones(j)]),
            np.concatenate([problem.lower, np.zeros(2 * j)]),
            np.concatenate([np.ones(k), np.full(2 * j, _INFINITY)]),
            matrix,
            np.concatenate([problem.c, base_lower, cut_lower]),
            np.concatenate([np.full(j, _INFINITY), base_upper, np.full(len(cuts), _INFINITY)]),
        )
        if status == _INFEASIBLE:
            yield None
            return
        if status != _OPTIMAL:
            return
        scaled = x[k:k + j]
        yield x[:k], scaled / root, duals[:j], duals[j:j + h]
        if j == 0:
            return
        fresh = [row for row in range(j) if not np.any(np.isclose(tangents[row], scaled[row], rtol=1e-12, atol=0))]
        if not fresh:
            return  # no new tangent: the outer approximation cannot improve
        for row in fresh:
            tangents[row].append(float(scaled[row]))


# Above this many arms, solve on a working set of arms and add those the optimality check prices in.
_WORKING_SET_FROM = 400
_WORKING_SET_STEP = 60


# From this many entries on, _smallest looks for the smallest ones among those below a level taken
# from a sample of about _SAMPLE_SIZE of them.
_SAMPLED_FROM = 4096
_SAMPLE_SIZE = 1024


def _smallest(values: np.ndarray, count: int, kth: int) -> np.ndarray:
    """Indices of the ``count`` smallest entries of ``values`` (1-D, count < its size), in no
    particular order: the set ``np.argpartition(values, kth)[:count]`` holds (kth is count or
    count - 1), which is that set whenever the count-th smallest entry is below the next one.

    With many entries, the candidates are those at or below a level read off a strided sample
    (about twice count of them are expected), and argpartition runs on them alone; when the level
    lets fewer than count + 1 entries through, or the count-th and the next smallest tie (then
    argpartition's own tie-breaking picks the set), argpartition runs on every entry as it is.
    """
    size = values.shape[0]
    if size >= _SAMPLED_FROM:
        step = size // _SAMPLE_SIZE
        sample = values[::step]
        position = min(sample.size - 1, math.ceil(2.0 * (count + 1) * sample.size / size) + 8)
        level = np.partition(sample, position)[position]
        if np.isfinite(level):
            candidates = np.flatnonzero(values <= level)
            if candidates.size > count:
                candidate_values = values[candidates]
                order = np.argpartition(candidate_values, count)
                chosen = order[:count]
                if np.max(candidate_values[chosen]) < candidate_values[order[count]]:
                    return candidates[chosen]
    return np.argpartition(values, kth)[:count]


def _solve_problem(problem: _Problem, hard_thresholds: np.ndarray, warm=None):
    """(p, mu, nu, exact) maximising the problem, or None if the hard guardrails are infeasible.

    With many arms, column generation: some optimum uses at most J + H + 1 arms above their lower
    bounds (a vertex argument), so the problem is solved on a working set (the best arms by each
    metric row, plus every arm with a lower bound) and the arms whose Lagrangian score beats the
    simplex multiplier are added until none does; that check is the full problem's optimality
    condition, so the answer is exact.
    """
    k = problem.k
    if k <= _WORKING_SET_FROM:
        return _solve_direct(problem, hard_thresholds, warm)
    rows = np.vstack([problem.a[None, :], problem.B, problem.D])
    negated = -rows
    working = np.unique(np.concatenate([_smallest(row, _WORKING_SET_STEP, _WORKING_SET_STEP) for row in negated]))
    for _ in range(50):
        # Arms outside the working set sit at their lower bounds: a constant part of every row.
        rest = np.ones(k, dtype=bool)
        rest[working] = False
        held = problem.lower[rest]
        sub_hard = hard_thresholds - problem.D[:, rest] @ held
        sub = _Problem(problem.a[working], problem.B[:, working], problem.c - problem.B[:, rest] @ held,
                       problem.lam, problem.D[:, working], sub_hard, problem.lower[working],
                       total=problem.total - held.sum())
        solved = _solve_direct(sub, sub_hard)
        if solved is None or not solved[3]:
            break  # infeasible on these arms, or not verified: solve the whole problem instead
        q, mu, nu, _ = solved
        scores = problem.scores(mu, nu)
        free = q > sub.lower
        tau = np.min(scores[working][free]) if free.any() else np.max(scores[working])
        tolerance = 1e-9 * problem.scale * problem.row_scale
        outside = np.setdiff1d(np.flatnonzero(scores > tau + tolerance), working)
        if outside.size == 0:
            p = problem.lower.copy()
            p[working] = q
            return p, mu, nu, True
        worst = outside[np.argsort(scores[outside])[-_WORKING_SET_STEP:]]
        working = np.union1d(working, worst)
    return _solve_direct(problem, hard_thresholds)


def _solve_direct(problem: _Problem, hard_thresholds: np.ndarray, warm=None):
    """(p, mu, nu, exact) maximising the problem with these hard thresholds, or None if infeasible.

    HiGHS meets its tolerances (about 1e-7) but not 1e-9 relative at lam = 1e9, and its QP solver
    is not dependable there; the optimum's active set is what matters, though: solving the KKT
    conditions on it gives the exact optimum, and :func:`_kkt_polish` accepts a candidate only if
    every optimality condition holds on all K arms. ``warm`` (free, soft active, hard active), the
    active set of a nearby problem's optimum, is tried first: where it passes the same checks,
    HiGHS is not needed.
    """
    if warm is not None:
        polished = _kkt_polish(problem, hard_thresholds, *warm)
        if polished is not None:
            return (*polished, True)
    best = None
    for candidate in _candidates(problem, hard_thresholds):
        if candidate is None:
            return None
        p, shortfall, highs_mu, highs_nu = candidate
        highs_mu, highs_nu = np.maximum(highs_mu, 0.0), np.maximum(highs_nu, 0.0)
        above = p - problem.lower
        hard_gap = problem.D @ p - hard_thresholds
        soft_gap = problem.c - problem.B @ p
        # Read the active set at a few resolutions; keep the first that passes every check.
        for resolution in (1e-9, 1e-7, 1e-5, 1e-11):
            free = above > resolution
            if not free.any():
                free = above >= np.max(above)
            short = (shortfall > resolution * 1e-3) | (soft_gap > resolution * problem.row_scale)
            # A soft guardrail can bind with a shortfall mu / (2 lam) below any resolution.
            soft_tight = short | (soft_gap > -resolution * problem.row_scale)
            tight = hard_gap < resolution * problem.row_scale
            guesses = [(short, tight & (highs_nu > resolution * problem.scale)), (short, tight),
                       (soft_tight | (highs_mu > resolution * problem.scale), tight)]
            for soft_active, hard_active in guesses:
                polished = _kkt_polish(problem, hard_thresholds, free, soft_active, hard_active)
                if polished is not None:
                    return (*polished, True)
        p = np.maximum(p, problem.lower)
        p = p * (problem.total / p.sum())
        mu = 2.0 * problem.lam * np.maximum(problem.c - problem.B @ p, 0.0)
        if best is None or problem.value(p) > problem.value(best[0]):
            best = (p, mu, highs_nu, False)
    # No active set verified: HiGHS's answer is only good to its tolerances (about 1e-7 of the
    # scaled data, e.g. two arms 1e-7 apart look equal to it). The best vertex is checked exactly
    # too, and the better of the two kept; without any HiGHS answer the vertex is the fallback.
    vertex = _vertex_fallback(problem, hard_thresholds)
    arm = int(np.argmax(vertex[0] - problem.lower)) if problem.total > problem.lower.sum() else 0
    free = np.zeros(problem.k, dtype=bool)
    free[arm] = True
    short = problem.c - problem.B @ vertex[0] > 0
    tight = problem.D @ vertex[0] - hard_thresholds <= 0
    for hard_active in (np.zeros_like(tight), tight):
        polished = _kkt_polish(problem, hard_thresholds, free, short, hard_active)
        if polished is not None:
            return (*polished, True)
    vertex_meets = np.all(problem.D @ vertex[0] >= hard_thresholds)
    if best is None or (vertex_meets and problem.value(vertex[0]) > problem.value(best[0])):
        return vertex
    return best


# HiGHS treats |values| >= 1e20 as infinite and drops matrix entries below 1e-9, while the API
# admits metric values, thresholds, weights and penalties up to 1e100: every row is scaled to unit
# size before HiGHS sees it. A soft penalty lam (c - B p)^2 keeps its value with the row divided by
# s and lam multiplied by s^2; the objective is divided by one positive size (the optimum p does not
# change) and shifted by a constant (a.p moves by the same amount for every mixture, as sum p is
# fixed). That size is the primary's spread over the arms, raised where needed so that no scaled
# penalty exceeds _LAM_LARGEST (the largest the solver is tested at; a primary then 1e-9 of the
# penalties' size is below every tolerance anyway). A scaled penalty below _LAM_NEGLIGIBLE moves the
# objective by less than 1e-16 of its size: its row is left out of HiGHS's problem (1 / sqrt(2 lam)
# would be an enormous coefficient) and its multiplier read off the result.
_LAM_NEGLIGIBLE = 1e-16
_LAM_LARGEST = 1e9


def _row_sizes(rows: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """max(|row|, |threshold|) per row, 1 for an all-zero row; (R,) from rows (R, K), thresholds (R,)."""
    sizes = np.maximum(np.max(np.abs(rows), axis=1, initial=0.0), np.abs(thresholds))
    return np.where(sizes > 0, sizes, 1.0)


def _vertex_fallback(problem: _Problem, hard_thresholds: np.ndarray):
    """(p, mu, nu, False): the best vertex (free mass on one arm) by (hard shortfall, value).

    Used only when HiGHS solved no formulation; the result is a feasible-if-possible mixture, not a
    verified optimum (``exact`` False, so the certificate ``optimality_gap`` tells how far it may be).
    """
    free = problem.total - problem.lower.sum()
    # Vertex k is lower + free e_k, so its rows are (rows @ lower) + free * rows[:, k]: (R, K).
    soft = (problem.B @ problem.lower)[:, None] + free * problem.B
    hard = (problem.D @ problem.lower)[:, None] + free * problem.D
    with np.errstate(over="ignore", invalid="ignore"):
        values = problem.a @ problem.lower + free * problem.a - np.sum(
            problem.lam[:, None] * np.maximum(problem.c[:, None] - soft, 0.0) ** 2, axis=0)
    shortfalls = np.maximum(np.max(hard_thresholds[:, None] - hard, axis=0, initial=0.0), 0.0)
    # Smallest hard shortfall first, then the best value (lexicographic; nan values last).
    order = np.lexsort((-np.nan_to_num(values, nan=-np.inf), shortfalls))
    best = problem.lower.copy()
    best[order[0]] += free
    mu = 2.0 * problem.lam * np.maximum(problem.c - problem.B @ best, 0.0)
    return best, mu, np.zeros(problem.D.shape[0]), False


def _solve_scaled(problem: _Problem, hard_thresholds: np.ndarray, warm=None):
    """:func:`_solve_problem` on the problem scaled to unit rows; (p, mu, nu, exact) in its own units.

    Degenerate problems are answered without HiGHS: one arm (p = 1), or arms that are all identical
    (every mixture has the same metrics; the free mass is spread evenly). None when infeasible.
    """
    k, h = problem.k, problem.D.shape[0]
    rows = np.vstack([problem.a[None, :], problem.B, problem.D])
    if k == 1 or np.all(rows == rows[:, :1]):
        p = problem.lower + (problem.total - problem.lower.sum()) / k
        if np.any(problem.D @ p < hard_thresholds):
            return None
        mu = 2.0 * problem.lam * np.maximum(problem.c - problem.B @ p, 0.0)
        return p, mu, np.zeros(h), True
    # A soft row is scaled by its reach, the largest shortfall any mixture can have (a row that
    # no arm falls short of never costs anything and is left out), bounded so that its entries stay
    # within 1e6 of it (HiGHS drops entries below 1e-9 and the row's own range must survive).
    reach = np.max(problem.c[:, None] - problem.B, axis=1, initial=-np.inf)
    soft_sizes = np.maximum(np.where(reach > 0, reach, 1.0), 1e-6 * _row_sizes(problem.B, problem.c))
    hard_sizes = _row_sizes(problem.D, hard_thresholds)
    spread = float(np.max(problem.a) - np.min(problem.a))
    # In logarithms: lam s^2 overflows at the API's magnitudes (1e100 * (1e100)^2).
    with np.errstate(divide="ignore"):
        log_weight = np.where(reach > 0, np.log(problem.lam) + 2.0 * np.log(soft_sizes), -np.inf)
    log_size = max(np.log(spread) if spread > 0 else -np.inf,
                   float(np.max(log_weight, initial=-np.inf)) - np.log(_LAM_LARGEST))
    if not np.isfinite(log_size):
        log_size = 0.0  # no primary spread and no penalty: every mixture is as good
    lam = np.exp(log_weight - log_size)
    kept = (lam >= _LAM_NEGLIGIBLE) & (reach > 0)
    a = (problem.a - np.min(problem.a)) / spread * np.exp(np.log(spread) - log_size) if spread > 0 else problem.a * 0.0
    scaled_thresholds = hard_thresholds / hard_sizes
    scaled = _Problem(
        a, problem.B[kept] / soft_sizes[kept, None], problem.c[kept] / soft_sizes[kept], lam[kept],
        problem.D / hard_sizes[:, None], scaled_thresholds, problem.lower, total=problem.total,
    )
    if warm is not None:
        free, soft_active, hard_active = warm
        # The warm active set's soft rows must all be in the scaled problem.
        warm = None if np.any(soft_active & ~kept) else (free, soft_active[kept], hard_active)
    solved = _solve_problem(scaled, scaled_thresholds, warm)
    if solved is None:
        return None
    p, scaled_mu, scaled_nu, exact = solved
    with np.errstate(over="ignore"):
        mu = np.zeros(problem.B.shape[0])
        mu[kept] = scaled_mu * np.exp(log_size - np.log(soft_sizes[kept]))
        # Rows left out: their multiplier 2 lam s at p (0 for a row no arm falls short of).
        left_out = ~kept
        mu[left_out] = 2.0 * problem.lam[left_out] * np.maximum(problem.c[left_out] - problem.B[left_out] @ p, 0.0)
        nu = scaled_nu * np.exp(log_size - np.log(hard_sizes))
    # A negligible penalty left out makes the answer exact to 1e-16 of the objective only.
    return p, mu, nu, exact and not np.any(left_out & (reach > 0))


def _largest_shortfall_margin_scaled(problem: _Problem, hard_thresholds: np.ndarray) -> float:
    """:func:`_largest_shortfall_margin` with every hard row divided by one common size (so the
    minimax stays in the metrics' own units); the best vertex's margin when HiGHS fails."""
    sizes = np.maximum(np.max(np.abs(problem.D), axis=1, initial=0.0), np.abs(hard_thresholds))
    size = float(np.max(sizes, initial=0.0)) or 1.0
    scaled = _Problem(np.zeros(problem.k), problem.B[:0], problem.c[:0], problem.lam[:0],
                      problem.D / size, hard_thresholds / size, problem.lower, total=problem.total)
    try:
        return _largest_shortfall_margin(scaled, hard_thresholds / size) * size
    except RuntimeError:
        p = _vertex_fallback(scaled, hard_thresholds / size)[0]
        return float(np.min(problem.D @ p - hard_thresholds, initial=0.0))


def solve(
    objective: Objective,
    means: np.ndarray,
    thresholds: np.ndarray | None = None,
    *,
    constraint_means: np.ndarray | None = None,
    min_shares: np.ndarray | None = None,
    fixed_shares: np.ndarray | None = None,
    warm_start: Solution | None = None,
) -> Solution:
    """The exact optimum max_p f(means p) over the simplex, with hard guardrails as constraints.

    Maximises the primary part minus the soft guardrails' quadratic penalties (``Objective.value``)
    subject to every hard guardrail, ``constraint_means[g_j] . p >= c_j``, and per-arm lower bounds.
    With no soft penalty this is a linear program, with some a convex quadratic program; both are
    solved by HiGHS (``highspy``), whose active set is then made exact by solving the KKT
    conditions on it and checking them on every arm (so the answer is exact for any penalty, also
    1e9). ``optimality_gap`` certifies the result by weak duality.

    Parameters
    ----------
    objective : Objective
    means : ndarray, shape (M, K)
        Means used for the objective (primary and soft guardrails).
    thresholds : ndarray, shape (G,), optional
        Resolved thresholds of all guardrails; defaults to ``objective.thresholds(means)`` (so a
        relative threshold is relative to the baseline arm's value in ``means``).
    constraint_means : ndarray, shape (M, K), optional
        Means used for the hard guardrails (e.g. lower confidence bounds); defaults to ``means``.
    min_shares : ndarray, shape (K,), optional
        Per-arm minimum share of the served mixture.
    fixed_shares : ndarray, shape (K,), optional
        Shares reserved per arm (e.g. a holdout on the baseline). The mixture counts them, so for
        the optimisation both are lower bounds: p_k >= max(min_shares_k, fixed_shares_k), which must
        sum to at most 1.
    warm_start : Solution, optional
        The solution of a nearby problem of the same objective and arms (e.g. another posterior
        draw of the same means): its ``active_set`` is tried first, and kept only if the KKT
        conditions hold on it exactly, so the answer is the same optimum, found without HiGHS
        when the active set has not changed (up to 400 arms; above, the working set's column
        generation solves as without it).

    Returns
    -------
    Solution
        When the hard guardrails cannot all be met (``feasible`` False), the returned mixture is the
        best one (by the objective) among those with the smallest largest shortfall
        max_j (c_j - y_j) (in each metric's own units), found by a first LP.

    Raises
    ------
    ValueError
        When shapes or shares are invalid or the means are not finite.
    """
    means = np.asarray(means, dtype=float)
    m = objective.n_metrics
    if means.ndim != 2 or means.shape[0] != m or means.shape[1] < 1:
        raise ValueError(f"The means must have shape ({m}, K) with K >= 1, got {means.shape}.")
    k = means.shape[1]
    if constraint_means is None:
        constraint_means = means
    constraint_means = np.asarray(constraint_means, dtype=float)
    if constraint_means.shape != means.shape:
        raise ValueError(f"The constraint means must have the means' shape {means.shape}, got {constraint_means.shape}.")
    if not (np.all(np.isfinite(means)) and (constraint_means is means or np.all(np.isfinite(constraint_means)))):
        raise ValueError("The means must be finite.")
    if thresholds is None:
        thresholds = objective.thresholds(means)
    thresholds = np.asarray(thresholds, dtype=float)
    if thresholds.shape != (len(objective.guardrails),):
        raise ValueError(
            f"The thresholds must have one entry per guardrail, shape ({len(objective.guardrails)},), "
            f"got {thresholds.shape}."
        )
    if not np.all(np.isfinite(thresholds)):
        raise ValueError("The thresholds must be finite.")
    lower = np.maximum(_as_shares("min_shares", min_shares, k), _as_shares("fixed_shares", fixed_shares, k))
    if lower.sum() > 1.0 + 1e-12:
        raise ValueError(
            f"The per-arm minimum and fixed shares together reserve {lower.sum():.6g} of the traffic; "
            "they can reserve at most 1."
        )
    lower = lower / max(1.0, lower.sum())
    warm = None if warm_start is None else warm_start.active_set
    if warm is not None:
        if warm[0].shape != (k,):
            raise ValueError(f"The warm start is a solution over {warm[0].shape[0]} arms; this problem has {k}.")
        n_soft = int(np.count_nonzero(objective.penalties[objective.soft_indices] > 0))
        if warm[1].shape != (n_soft,) or warm[2].shape != (objective.hard_indices.size,):
            raise ValueError("The warm start is a solution of an objective with other guardrails than this one.")
    return _solve_checked(objective, means, thresholds, constraint_means, lower, warm)


def _solve_checked(objective, means, thresholds, constraint_means, lower, warm=None) -> Solution:
    rows = objective.guardrail_rows
    soft = objective.soft_indices[objective.penalties[objective.soft_indices] > 0]
    hard = objective.hard_indices
    problem = _Problem(
        a=objective.primary_weights @ means,
        soft_rows=means[rows[soft]],
        soft_thresholds=thresholds[soft],
        lam=objective.penalties[soft],
        hard_rows=constraint_means[rows[hard]],
        hard_thresholds=thresholds[hard],
        lower=lower,
    )
    feasible = True
    hard_thresholds = problem.d
    solved = _solve_scaled(problem, hard_thresholds, warm)
    if solved is None:
        # Phase one: the smallest largest shortfall t*, then the best mixture meeting c - t*.
        best_margin = _largest_shortfall_margin_scaled(problem, hard_thresholds)
        tolerance = 1e-9 * _row_sizes(problem.D, hard_thresholds)
        feasible = bool(np.all(best_margin >= -tolerance))
        hard_thresholds = problem.d + min(best_margin, 0.0) - tolerance
        solved = _solve_scaled(problem, hard_thresholds)
        if solved is None:
            # Met by the phase-one mixture up to HiGHS's tolerance only: its best vertex instead.
            solved = _vertex_fallback(problem, hard_thresholds)
    p, mu, nu, exact = solved
    # Rounding (a rescaled polish, HiGHS's tolerances) can leave p a hair below its lower bounds:
    # the mass above them is renormalised so that p >= lower and sum p = 1 hold exactly.
    above = np.maximum(p - lower, 0.0)
    free = 1.0 - lower.sum()
    p = lower + (above * (free / above.sum()) if above.sum() > 0 else free / len(p))
    value = float(objective.mixture_value(means, p, thresholds))
    slack = problem.D @ p - problem.d
    # Phase one's minimax is in common units, where a row far smaller than the others can look met.
    feasible = feasible and bool(np.all(slack >= -1e-9 * _row_sizes(problem.D, problem.d)))
    largest_shortfall = float(max(0.0, -np.min(slack, initial=0.0)))
    if feasible:
        shadow_prices = nu
        # Weak duality: any mu, nu >= 0 bound the optimum from above.
        gap = max(0.0, problem.dual_value(mu, nu) - problem.value(p))
    else:
        shadow_prices = np.full(hard.size, np.nan)
        gap = float("nan")
    # The active set as _kkt_polish reads it (arms above their bounds by more than its 1e-9,
    # multipliers > 0): a warm start for a nearby problem, checked there like any other guess.
    active_set = (p - lower > 1e-9, mu > 0, nu > 0) if exact and feasible else None
    return Solution(
        probabilities=p,
        value=value,
        feasible=bool(feasible),
        shadow_prices=shadow_prices,
        hard_slack=slack,
        largest_shortfall=largest_shortfall,
        optimality_gap=float(gap),
        active_set=active_set,
    )


@dataclass(frozen=True)
class ExpectedSolution:
    """The maximiser of the expected objective on one problem (see :func:`expected_optimum`).

    Attributes
    ----------
    probabilities : ndarray, shape (K,)
        The mixture (on the simplex, at or above the per-arm lower bounds).
    value : float
        E f(mu p) at ``probabilities``.
    optimality_gap : float
        The Frank-Wolfe gap max_v grad . (v - p) over the feasible vertices v: an upper bound on
        (optimum - value), since E f is concave.
    iterations : int
        Newton steps taken.
    """

    probabilities: np.ndarray
    value: float
    optimality_gap: float
    iterations: int


# Newton steps of expected_optimum at most; each is one convex QP (HiGHS) and a line search.
_NEWTON_STEPS = 40
# Arms by gradient that join expected_optimum's working set at each Newton step.
_WORKING_ARMS = 32
# Optimality gap at which expected_optimum stops, relative to the spread of the arms' primary values.
_NEWTON_TOLERANCE = 1e-6


def expected_optimum(
    objective: Objective,
    means: np.ndarray,
    standard_errors: np.ndarray,
    thresholds: np.ndarray | None = None,
    *,
    min_shares: np.ndarray | None = None,
    start: np.ndarray | None = None,
    constraints: tuple[np.ndarray, np.ndarray] | None = None,
) -> ExpectedSolution:
    """max_p E f(mu p) over the simplex (p >= min_shares, A p >= c), mu ~ N(means, se^2) entrywise.

    E f (:func:`expected_objective`) is concave and smooth in p but not quadratic: each soft
    guardrail's expected squared shortfall depends on the slack's mean d (linear in p) and variance
    v (quadratic in p, the reference arm of a relative threshold included). It is maximised by
    Newton's method: each step solves exactly (HiGHS) the convex QP of the second-order model of
    E f at the current mixture over the whole feasible set, so the support can change freely in
    one step (unlike multiplicative updates, which need many steps to bring back an arm they
    pushed to e^-30), then a backtracking line search keeps E f increasing. The model's curvature
    is that of each penalty in (d, v), clipped to be positive semidefinite, plus the curvature of v
    itself. It stops when the Frank-Wolfe gap, an upper bound on the distance to the optimum,
    is below a millionth of the spread of the arms' primary values, or after 40 steps; the gap is
    returned either way.

    Parameters
    ----------
    objective : Objective
        Its hard guardrails are not in E f: with any, ``constraints`` must hold them.
    means, standard_errors : ndarray, shape (M, K)
        Posterior means and standard deviations (>= 0; an infinite one counts as its row's largest
        finite one).
    thresholds : ndarray, shape (G,), optional
        Resolved thresholds; ``objective.thresholds(means)`` by default.
    min_shares : ndarray, shape (K,), optional
        Per-arm minimum shares (summing to at most 1).
    start : ndarray, shape (K,), optional
        First iterate (e.g. the previous round's optimum); the exact optimum of f(means p)
        (:func:`solve`) when omitted or spread over more than 32 arms.
    constraints : (ndarray (H, K), ndarray (H,)), optional
        Linear constraints A p >= c the mixture must meet (the hard guardrails on the bounds the
        caller chooses, e.g. pessimistic ones). Every Newton model and the optimality gap are
        solved over them; a ``start`` that misses one is replaced by the feasible mixture with
        the best primary value (a linear program). ``ValueError`` when no mixture meets them.
    """
    means = np.asarray(means, dtype=float)
    k = means.shape[-1]
    if means.ndim != 2 or means.shape[0] != objective.n_metrics or not np.all(np.isfinite(means)):
        raise ValueError(f"The means must be finite with shape ({objective.n_metrics}, K), got {means.shape}.")
    errors = np.asarray(standard_errors, dtype=float)
    if errors.shape != means.shape or np.any(errors < 0) or np.any(np.isnan(errors)):
        raise ValueError(f"The standard errors must be >= 0 with the means' shape {means.shape}.")
    if objective.hard_indices.size and constraints is None:
        raise ValueError("The objective has hard guardrails: pass them to expected_optimum as constraints "
                         "(rows A p >= c on the bounds they must hold on), or use solve.")
    thresholds = objective.thresholds(means) if thresholds is None else np.asarray(thresholds, dtype=float)
    lower = _as_shares("min_shares", min_shares, k)
    if lower.sum() > 1.0 + 1e-12:
        raise ValueError(f"The minimum shares reserve {lower.sum():.6g} of the traffic; they can reserve at most 1.")
    lower = lower / max(1.0, lower.sum())
    free = 1.0 - lower.sum()
    rows = None
    if constraints is not None:
        matrix, bounds = (np.asarray(part, dtype=float) for part in constraints)
        if matrix.ndim != 2 or matrix.shape[1] != k or bounds.shape != matrix.shape[:1]:
            raise ValueError(f"The constraints must be an (H, {k}) matrix and (H,) bounds, got {matrix.shape} "
                             f"and {bounds.shape}.")
        rows = _unit_rows(matrix, bounds) if matrix.shape[0] else None

    def best_vertex(gradient):
        """argmax over the feasible set of gradient . q (a linear program with constraints)."""
        if rows is None:
            vertex = lower.copy()
            vertex[np.argmax(gradient)] += free
            return vertex
        # In units of the gradient's largest entry (HiGHS's tolerances are absolute).
        size = float(np.abs(gradient).max())
        solved, x, _ = linear_program(-gradient / (size if size > 0 else 1.0), -rows[0], -rows[1], np.ones((1, k)),
                                      [1.0], lower=lower)
        if not solved:
            raise ValueError("No mixture meets the constraints given to expected_optimum.")
        return np.maximum(x, lower)

    # A start spread over many arms (the uniform first round) would make the first Newton models as
    # wide as K; the exact optimum of f(means p) is sparse and near the hedged one.
    if rows is not None:
        p = None
        if start is not None and np.count_nonzero(start) <= _WORKING_ARMS:
            p = lower + free * _on_simplex(np.maximum(np.asarray(start, dtype=float) - lower, 0.0))
            slack_tolerance = 1e-9 * (np.abs(rows[1]) + np.abs(rows[0]).max(axis=1, initial=0.0))
            if np.any(rows[0] @ p < rows[1] - slack_tolerance):
                p = None
        if p is None:
            p = best_vertex(objective.primary_weights @ means)
    elif start is None or np.count_nonzero(start) > _WORKING_ARMS:
        p = solve(objective, means, thresholds, min_shares=lower).probabilities
    else:
        p = lower + free * _on_simplex(np.maximum(np.asarray(start, dtype=float) - lower, 0.0))
    variances = _guardrail_variances(objective, errors)
    soft = objective.soft_indices[objective.penalties[objective.soft_indices] > 0]
    weights = objective.threshold_weights(k)

    def evaluate(q):
        value, gradient = expected_objective(objective, means, variances, thresholds, q)
        return float(value), gradient

    def frank_wolfe_gap(q, gradient):
        if rows is None:
            return float(free * np.max(gradient) + lower @ gradient - q @ gradient)
        return float(best_vertex(gradient) @ gradient - q @ gradient)

    working = (lower > 0) | np.any(weights != 0, axis=0)
    value, gradient = evaluate(p)
    # Scale-free: a millionth of the spread of the arms' primary values (a metric around 100 with
    # effects of 0.2 and one around 0 with effects of 1 are solved alike).
    scale = float(np.ptp(objective.primary_weights @ means))
    tolerance = _NEWTON_TOLERANCE * scale + 1e-12 * (1.0 + abs(value))
    steps = 0
    for steps in range(1, _NEWTON_STEPS + 1):
        if frank_wolfe_gap(p, gradient) <= tolerance:
            steps -= 1
            break
        # The model is built over a working set of arms (column generation): those with mass, a
        # minimum share or a threshold weight, and the best _WORKING_ARMS by gradient. The others
        # stay at 0 in the step; the gap, over every arm, brings in any that should join. So a
        # model has O(support) columns, not O(K) (at K = 100,000 a QP over every arm took minutes).
        working |= p > 0
        working[_smallest(-gradient, min(_WORKING_ARMS, k), min(_WORKING_ARMS, k) - 1)] = True
        arms = np.flatnonzero(working)
        step = _newton_direction(objective, means[:, arms], variances[:, arms], thresholds, weights[:, arms],
                                 soft, p[arms], gradient[arms], lower[arms], scale,
                                 None if rows is None else (rows[0][:, arms], rows[1]))
        # HiGHS could not solve the model, or its step is lost in its tolerances (a steep penalty
        # leaves a gap that a step of 1e-8 closes; HiGHS returns 0): a Frank-Wolfe step (towards
        # the best vertex) instead. The vertex is found only then (with constraints, an LP).
        moved = False
        if step is not None:
            newton = np.zeros(k)
            newton[arms] = step
            moved, p, value, gradient = _backtrack(evaluate, p, value, gradient, newton)
        if not moved:
            moved, p, value, gradient = _backtrack(evaluate, p, value, gradient, best_vertex(gradient) - p)
        if not moved:
            break
    p = lower + free * _on_simplex(np.maximum(p - lower, 0.0))
    value, gradient = evaluate(p)
    return ExpectedSolution(probabilities=p, value=value, optimality_gap=max(0.0, frank_wolfe_gap(p, gradient)),
                            iterations=steps)


def _backtrack(evaluate, p, value, gradient, direction):
    """Backtracking (Armijo) line search from ``p`` along ``direction``: (moved, p, value, gradient)."""
    slope = float(gradient @ direction)
    if slope > 0:
        size = 1.0
        for _ in range(60):
            candidate = p + size * direction
            candidate_value, candidate_gradient = evaluate(candidate)
            if candidate_value >= value + 1e-4 * size * slope:
                return True, candidate, candidate_value, candidate_gradient
            size *= 0.5
    return False, p, value, gradient


def _unit_rows(matrix: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows A p >= c, (H, K) and (H,), each divided by its largest coefficient or bound in absolute value."""
    size = np.maximum(np.abs(matrix).max(axis=1, initial=0.0), np.abs(bounds))
    size = np.where(size > 0, size, 1.0)
    return matrix / size[:, None], bounds / size


def _on_simplex(mass: np.ndarray) -> np.ndarray:
    """Non-negative ``mass`` (K,) scaled to sum 1 (uniform when it is all 0)."""
    total = mass.sum()
    return mass / total if total > 0 else np.full(mass.shape, 1.0 / mass.size)


def _newton_direction(objective, means, variances, thresholds, weights, soft, p, gradient, lower, scale,
                      constraints=None):
    """q - p for q maximising the second-order model of E f at p over the feasible set; None if HiGHS fails.

    ``constraints`` (A (H, K), c (H,)): rows A q >= c of the feasible set besides the simplex.

    The model is g . delta - delta^T H delta / 2 (delta = q - p), H the exact Hessian of the
    penalties: for soft guardrail j with slack mean d = mu[g_j] . delta + ... and variance
    v = sum_k var_k c_k^2 (c = p - w_j), the penalty G(d, v) = E min(0, S)^2 has curvature

        delta^T H_j delta = C11 a^2 + 2 C12 a b + C22 b^2 + 2 G_v delta^T diag(var) delta,

    with a = mu[g_j] . delta, b = 2 (var c) . delta, C = G's Hessian in (d, v) (indefinite), and
    G_v = Phi(-d/s). Writing delta^T diag(var) delta = b^2 / (4 v) + min_t |delta - t c|^2_var
    moves b^2 G_v / (2 v) into C, which makes it positive semidefinite (its determinant is
    (Phi^2 + z phi Phi - phi^2) / s^2 >= 0, z = d / s), and leaves a residual that is a sum of
    squares of the extra free columns r = delta - t c. So the QP, in (q, r_j, t_j, a_j, b_j), has a
    diagonal positive semidefinite Hessian (HiGHS) and O(G K) columns, and its solution is the exact
    Newton step.
    """
    k = p.shape[0]
    x = means @ p
    rows = objective.guardrail_rows
    columns = [np.zeros(k)]  # Hessian diagonal, block by block; q's own block is 0.
    links = []  # (coefficients on q, coefficient on the new column(s), right-hand side)
    blocks = []  # per guardrail: ([(row of q-coefficients, curvature)], residual block or None)
    for j in soft:
        lam = objective.penalties[j]
        c = p - weights[j]
        var = variances[j]
        v = float(np.sum(var * c**2))
        d = float(x[rows[j]] - thresholds[j])
        if v > 1e-300:
            s = math.sqrt(v)
            z = d / s
            tail, density = float(ndtr(-z)), math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
            curvature = np.array([[2.0 * tail, -density / s],
                                  [-density / s, density * z / (2.0 * v) + tail / (2.0 * v)]])
            basis = np.vstack([means[rows[j]], 2.0 * var * c])
            residual = 2.0 * tail * var
        else:
            curvature = np.array([[2.0 if d < 0 else (1.0 if d == 0 else 0.0)]])
            basis = means[rows[j]][None, :]
            residual = None
        eigenvalues, eigenvectors = np.linalg.eigh(curvature)
        # Curvature below 1e-12 of the primary values' spread (per unit of mass moved) is none: a
        # guardrail 20 standard errors clear has tails of 1e-89, which only unsettle HiGHS.
        negligible = 1e-12 * scale
        terms = [(row, lam * value) for value, row in zip(eigenvalues, eigenvectors.T @ basis)
                 if lam * value * np.max(np.abs(row)) ** 2 > negligible]
        if residual is not None:
            residual = np.where(lam * residual > negligible, lam * residual, 0.0)
        blocks.append((terms, None if residual is None or not residual.any() else (residual, c)))
    # Columns: q (K), then per guardrail its rank-one columns a_e = b_e . (q - p), then r (K) and t
    # with r = q - p - t c.
    n_extra = sum(len(terms) + (0 if residual is None else k + 1) for terms, residual in blocks)
    n = k + n_extra
    # The constraint matrix in coordinates (row, column, value): O(G K) entries, never K x K.
    entries = [(np.zeros(k, dtype=int), np.arange(k), np.ones(k))]
    right = [1.0]
    hessian = np.zeros(n)
    row, column = 1, k
    arms = np.arange(k)
    # Every extra column is scaled to curvature 1 (its row multiplied by the root of its curvature):
    # a penalty of 1000 on a metric known to 1e-3 puts curvatures from 1e-3 to 1e10 in one model,
    # which HiGHS's QP solver does not survive. The model is divided by the primary values' spread
    # too: HiGHS's tolerances are absolute, and with metrics around 1e-3 a model in their units was
    # solved so loosely that a Newton step pointed downhill (the optimiser stopped far from the optimum).
    unit = scale if scale > 0 else 1.0
    for terms, residual in blocks:
        for coefficients, value in terms:
            root = math.sqrt(value / unit)
            entries.append((np.full(k + 1, row), np.append(arms, column), np.append(root * coefficients, -1.0)))
            right.append(float(root * coefficients @ p))
            hessian[column] = 1.0
            row, column = row + 1, column + 1
        if residual is not None:
            weight, c = residual
            root = np.sqrt(weight / unit)
            lines = row + arms
            entries += [(lines, arms, root), (lines, column + arms, -np.ones(k)),
                        (lines, np.full(k, column + k), -root * c)]
            right.extend(root * p)
            # t is the minimiser (weight c) . delta / (c . weight c), fixed by its own row: HiGHS's QP
            # solver fails on a free column without curvature.
            pull = weight * c
            entries += [(np.full(k + 1, row + k), np.append(arms, column + k), np.append(pull, -float(pull @ c)))]
            right.append(float(pull @ p))
            hessian[column:column + k] = 1.0
            row, column = row + k + 1, column + k + 1
    right = np.asarray(right)
    row_upper = right
    if constraints is not None:
        # Each row in its own units divided out, for the same reason.
        constraint_matrix, constraint_bounds = _unit_rows(*constraints)
        for h in range(constraint_matrix.shape[0]):
            entries.append((np.full(k, row), arms, constraint_matrix[h]))
            row += 1
        right = np.concatenate([right, constraint_bounds])
        row_upper = np.concatenate([row_upper, np.full(constraint_bounds.shape, _INFINITY)])
    rows_, columns_, values_ = (np.concatenate(part) for part in zip(*entries))
    matrix = _Coordinates(rows_, columns_, values_, (row, n))
    cost = np.concatenate([-gradient / unit, np.zeros(n_extra)])
    status, solution, _ = _highs(cost, np.concatenate([lower, np.full(n_extra, -_INFINITY)]),
                                 np.full(n, _INFINITY), matrix, right, row_upper, hessian)
    q = solution[:k]
    # HiGHS's QP solver reports a solve error when its optimum misses a row by more than its
    # tolerance (seen at 7e-5 with penalties of 1e6): the step is still a good direction, projected
    # back on the feasible set, and the line search and the gap judge it.
    if not (status == _OPTIMAL or (np.all(np.isfinite(q)) and abs(q.sum() - 1.0) < 1e-3)):
        return None
    q = np.maximum(q, lower)
    return q / q.sum() - p


def best_mixture(
    objective: Objective, means: np.ndarray, thresholds: np.ndarray | None = None
) -> tuple[np.ndarray, float | np.ndarray]:
    """The best mixture p* = argmax_p f(mu p) on the simplex (hard guardrails kept) and its value.

    Each problem is solved exactly by :func:`solve`; with infeasible hard guardrails, its mixture
    (smallest largest shortfall) and value are returned.

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
        solution = solve(objective, means[index], thresholds[index])
        probabilities[index], values[index] = solution.probabilities, solution.value
    if not batch:
        return probabilities, float(values)
    return probabilities, values


def best_single(
    objective: Objective, means: np.ndarray, thresholds: np.ndarray | None = None
) -> tuple[int | np.ndarray, float | np.ndarray]:
    """The best single arm argmax_k f(mu[:, k]) among the arms meeting every hard guardrail.

    An arm breaking a hard guardrail (by more than 1e-12 relative) is not eligible. When no arm is
    eligible, the arm with the smallest largest hard shortfall is returned (ties: the best value),
    the single-arm counterpart of :func:`solve`'s infeasible answer.

    Parameters
    ----------
    objective : Objective
    means : ndarray, shape (..., M, K)
    thresholds : ndarray, shape (..., G), optional
        Defaults to ``objective.thresholds(means)``.

    Returns
    -------
    (int or ndarray, float or ndarray)
        The arm index and its value f (arrays with the batch shape when batched).
    """
    means = np.asarray(means, dtype=float)
    if thresholds is None:
        thresholds = objective.thresholds(means)
    thresholds = np.asarray(thresholds, dtype=float)
    per_arm = np.swapaxes(means, -1, -2)
    values = objective.value(per_arm, thresholds[..., None, :])
    slack = objective.hard_slack(per_arm, thresholds[..., None, :])
    scale = 1.0 + np.abs(thresholds[..., None, objective.hard_indices])
    shortfall = np.max(np.maximum(-slack / scale, 0.0), axis=-1, initial=0.0)
    eligible = shortfall <= 1e-12
    none_eligible = ~np.any(eligible, axis=-1, keepdims=True)
    # Among eligible arms the best value; with none, the smallest shortfall, then the best value.
    least = np.min(shortfall, axis=-1, keepdims=True)
    candidates = np.where(none_eligible, shortfall <= least, eligible)
    index = np.argmax(np.where(candidates, values, -np.inf), axis=-1)
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
