"""Safe serving: what is served keeps the guardrails, exploration is Thompson sampling and shrinks.

The paper's Algorithm 1 guarantees the *average* of the served mixtures p_t; users live with every
p_t. This controller chooses each round's p_t from per-arm confidence bounds:

1. **Estimate.** Per arm and metric, the sample mean of the observations since the last detected
   change, shrunk by an empirical-Bayes normal prior centred on the pooled mean across arms (the
   prior variance is the spread of the arms' means beyond their noise, the Paule-Mandel estimate,
   which weighs each arm by its own precision), so that arms with little or no data still get a
   finite mean and standard error. The noise variance of an arm is its own
   sample variance pooled with the metric's within-arm variance over all arms.
2. **Pessimistic constraints.** Every hard guardrail becomes linear constraints ``A p >= c`` on lower
   confidence bounds L = mean - z se (one-sided level ``level``, 95% by default); for the served
   mixture the bounds are simultaneous over the K arms (each at 1 - (1 - level) / K), for the
   deployed mixture (step 5) per arm. An absolute
   guardrail reads ``L_g . p >= c_g``. A relative one, ``mu_g . p >= (1 + theta) mu_g,b``, is
   pessimistic in both the arms and the reference arm b: ``sum_{k != b} p_k L_k + (p_b - 1 - theta)
   B_b >= 0`` for B_b = U_b and B_b = L_b (two rows: the coefficient of mu_b changes sign at
   p_b = 1 + theta). The baseline arm (``Objective.baseline_index``, known to be acceptable) is
   treated as meeting every absolute guardrail (its coefficient is max(L, c)) while its own upper
   bound does not refute that, so padding with it restores feasibility.
3. **Serve.** With hard guardrails: Thompson sampling with the constraints drawn too. Each of
   ``posterior_draws`` posterior draws of the means is solved exactly (the LP max mu_primary . p
   subject to every hard guardrail on the drawn means), so an arm that could enter the optimal
   support, or make room for others under the guardrails, gets traffic as often as the posterior
   says it could, and that traffic shrinks as the posterior concentrates. No fixed exploration
   floor. The draws' average is padded, just enough that every lower bound holds, with the
   mixture of largest worst relative slack on the lower bounds (the
   baseline whenever it is trusted); a bound that mixture holds with less slack than
   ``HOLD_TOLERANCE`` of its scale (a baseline on its threshold) is relaxed by the difference, so
   the other arms keep that much room to be learnt in. While no mixture keeps the lower bounds (the first rounds; a
   baseline its own data refute, or none), it is served as it is: exploring is the way to find out.
   Without hard guardrails (soft penalties only, or none): Thompson sampling over safe mixtures.
   The hedged plug-in optimum of E f(mu p) (solved to a certified gap by
   :func:`pasto.optimum.expected_optimum`, Newton steps that are each an exact QP; a relative
   threshold's reference arm is uncertain too) says how far each soft guardrail is hedged. Each of
   ``posterior_draws`` posterior draws of the means is solved exactly (:func:`pasto.optimum.solve`)
   with a guardrail the optimum keeps (a steep penalty) on its pessimistic bounds and one it
   trades against the primary metric (a mild penalty) moved only by the rest of the plug-in's
   hedge (:func:`_kept_margins`), and the
   average of the draws' optima is served (:func:`_safe_posterior_mixture`): an arm gets its
   posterior chance of belonging to the optimal mixture times its share there, exploration that
   vanishes as the posterior concentrates, and a guardrail the optimum keeps is kept by what is
   served. While no mixture is defended against the best single arm (step 5), the deploy test
   chooses between the two, so half of the traffic follows each arm's posterior probability of
   being the best single arm (:func:`best_arm_probabilities`; the top-two Thompson split) until
   that probability names one arm at ``deploy_level``: then that half goes to the best known safe
   mixture (the estimated means solved as the draws are). The
   starting mixture (the production setting, else uniform), from which the deployed mixture leaves
   only as far as the evidence defends, is observed as much as that test needs
   (:func:`_observe_start`).
4. **Fixed shares.** Optional per-arm ``min_share`` and a ``holdout`` share on the baseline arm are
   carved out first: p = fixed + (1 - sum fixed) q, q optimised on the simplex.
5. **Deploy what can be defended.** The plug-in mixture (pessimistic hard constraints, no
   optimism, no fixed shares) is chosen when it beats the best single arm (the arm a best-arm
   bandit settles on: the highest posterior expected objective among the arms that meet the hard
   constraints on their lower bounds) with posterior probability above ``deploy_level``: with soft
   guardrails estimated by drawing the two mixtures' metric vectors and the reference means of
   relative thresholds (:func:`_probability_better`), otherwise in closed form (its posterior
   expected objective ahead by ``z_deploy`` standard errors of the difference, delta method, the
   reference arm of a relative threshold included). Otherwise that single arm is deployed (with
   soft guardrails, moved towards the plug-in mixture as far as the same test defends: the gain is
   concave in the step, its noise about linear, so part of the way can be defended where the
   whole is not). What is served reads the delta method's answer to this test (which runs are
   undecided, step 3), the deployed mixture the probability's. An undecided run whose test
   would pass with more observations of a relative threshold's reference arm (the estimates
   unchanged) observes it that far when the mixture's advantage over the horizon pays for it
   (:func:`_reference_counts_to_defend`). With soft guardrails the deployed mixture is then the
   starting mixture (the baseline arm, else uniform) moved towards that choice only as far as the
   evidence defends (conservative bandits:
   p0 + a (choice - p0) with the largest a in {0, 0.1, ..., 1} that beats p0 with posterior
   probability above ``deploy_level``, Student's t on the pooled degrees of freedom). With soft
   guardrails these tests take each arm's standard error as at least the one its metric's pooled
   noise variance gives (a skewed metric's own sample variance is most often low); the posterior
   draws keep the arm's own.
6. **Change.** Every ``change_every`` rounds the latest windows of observations are compared with
   the earlier ones since the last reset, per arm and metric, by a self-normalised statistic whose
   level does not rest on normal tails (:func:`change_detected`); ``change_level`` bounds the chance
   of any false alarm in a whole stationary run. A detected change drops every observation so far;
   the run is served uniformly, keeping its deployed mixture, until its bounds are defined again.

Randomness (the posterior draws) comes from the generator the caller passes.

:func:`pasto.algorithm.update` runs this controller for the ``default`` preset (``serving =
"safe"``), in the service and in the simulator alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pasto.estimators import Estimate, Statistics
from pasto.objectives import HOLD_TOLERANCE, Objective
from pasto.optimum import expected_optimum, linear_program, solve
from pasto.special import ndtr, ndtri, stdtrit

__all__ = [
    "ServingConfig",
    "HardConstraints",
    "has_hard_guardrails",
    "arm_posterior",
    "best_arm_probabilities",
    "change_detected",
    "change_threshold",
    "CHANGE_WINDOWS",
    "choose",
    "hard_constraints",
    "served_lp",
    "starting_probabilities",
]

# Prior degrees of freedom pooling an arm's own noise variance with the metric's pooled one.
_VARIANCE_PRIOR_DF = 5.0
# Shares of a plug-in solution below this fraction of its largest are served as 0 (a line search's
# last step can leave such crumbs on an arm that leaves the support).
_NEGLIGIBLE = 1e-9


@dataclass(frozen=True)
class ServingConfig:
    """Settings of safe serving.

    Attributes
    ----------
    level : float
        One-sided confidence level of the hard guardrails' lower bounds, in (0.5, 1) (0.95).
    min_share : float
        Share every arm keeps, in [0, 1 / K) (0: no floor).
    holdout : float
        Fixed share of the baseline arm, in [0, 1) (0: none; needs a baseline arm).
    deploy_level : float
        One-sided confidence with which the deployed mixture must beat the best single arm,
        (soft guardrails) with which it must beat the starting mixture before it leaves it, and with
        which an undecided run's best single arm counts as found (its best-arm half then goes to
        the best known safe mixture).
    change_level : float
        Probability that the change detector ever raises a false alarm over a whole run whose means
        never change, in [0, 1) (0 disables detection; :func:`change_detected`).
    change_every : int
        Rounds per change-test block: the detector looks every ``change_every`` rounds.
    posterior_draws : int
        Posterior draws of the means per round (0 to 64), each solved exactly: with soft
        guardrails (:func:`pasto.optimum.solve`) with the guardrails the plug-in optimum keeps on
        their pessimistic bounds (Thompson sampling over safe mixtures,
        :func:`_safe_posterior_mixture`), with hard ones the LP on the drawn means, then padded
        to the lower bounds (module docstring, step 3); their optima's average is served. 4 by
        default: the served share of an arm
        estimates its expected share under the posterior, with noise falling like
        1 / sqrt(draws), at one exact solve each; the objective is concave in the mixture, so
        serving that average is worth at least the average of the draws' values (Jensen). 0 serves
        the best known safe mixture (the estimated means solved the same way): no exploration
        beyond the best-arm half of undecided runs and the observations the deploy tests need.
    """

    level: float = 0.95
    min_share: float = 0.0
    holdout: float = 0.0
    deploy_level: float = 0.95
    change_level: float = 0.01
    change_every: int = 25
    posterior_draws: int = 4

    def __post_init__(self) -> None:
        for name in ("level", "min_share", "holdout", "deploy_level", "change_level"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Serving option {name!r} must be a finite number, got {value!r}.")
            object.__setattr__(self, name, float(value))
        for name in ("level", "deploy_level"):
            if not 0.5 < getattr(self, name) < 1.0:
                raise ValueError(f"Serving option {name!r} must be in (0.5, 1), got {getattr(self, name)}.")
        for name in ("min_share", "holdout", "change_level"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"Serving option {name!r} must be in [0, 1), got {getattr(self, name)}.")
        for name in ("change_every",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Serving option {name!r} must be an integer >= 1, got {value!r}.")
        value = self.posterior_draws
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
            raise ValueError(
                f"Serving option 'posterior_draws' must be an integer from 0 to 64, got {value!r}."
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServingConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Unknown serving option(s) {unknown}; the options are {sorted(names)}.")
        return cls(**data)


@dataclass(frozen=True)
class HardConstraints:
    """Hard guardrails as pessimistic linear constraints ``A p >= c``.

    Attributes
    ----------
    matrix : ndarray, shape (..., H, K)
        A; H = one row per absolute and two per relative hard guardrail.
    bounds : ndarray, shape (..., H)
        c.
    scale : ndarray, shape (..., H)
        Positive scale of each row (|threshold|, or 1), for relative slacks.
    """

    matrix: np.ndarray
    bounds: np.ndarray
    scale: np.ndarray

    @property
    def count(self) -> int:
        return int(self.matrix.shape[-2])


def has_hard_guardrails(objective: Objective) -> bool:
    """Whether some guardrail of ``objective`` is a hard constraint."""
    return any(_is_hard(g) for g in objective.guardrails)


def _is_hard(guardrail) -> bool:
    return bool(getattr(guardrail, "hard", False))


def _baseline_index(objective: Objective) -> int | None:
    index = getattr(objective, "baseline_index", None)
    return None if index is None else int(index)


def _arm_index(objective: Objective, name: str) -> int:
    return list(objective.arm_names).index(name)


# --------------------------------------------------------------------------- estimate


def arm_posterior(statistics: Statistics, pooled_noise: bool = False) -> Estimate:
    """Empirical-Bayes per-arm means and standard errors; shapes (..., M, K).

    Each metric's arm means get the normal prior N(m, tau^2): tau^2 the Paule-Mandel estimate of
    the observed arms' spread beyond their own sampling variances, m their mean weighted by
    1 / (tau^2 + se_k^2) (:func:`_between_arm_variance`; tau^2 at least 1% of their plain
    variance). Arm k's noise variance pools its sample variance (n_k - 1 degrees of freedom)
    with the metric's within-arm variance (``_VARIANCE_PRIOR_DF``). Posterior precision
    1 / tau^2 + n_k / s_k^2. Entries are infinite (standard error) while fewer than two arms of a
    metric have data or no arm has two observations.

    With ``pooled_noise`` every arm's noise variance is the metric's pooled within-arm variance
    alone (what the deploy tests bound an arm's own with: :func:`choose`).
    """
    n = statistics.counts
    has = n > 0
    mean, centred, df, pooled_var = _within_arm_variance(statistics)
    with np.errstate(invalid="ignore"):
        noise_var = np.where(
            np.isfinite(pooled_var),
            (centred + _VARIANCE_PRIOR_DF * np.where(np.isfinite(pooled_var), pooled_var, 0.0))
            / (df + _VARIANCE_PRIOR_DF),
            np.inf,
        )
        if pooled_noise:
            noise_var = np.broadcast_to(pooled_var, noise_var.shape)
    noise_var = np.maximum(noise_var, 1e-300)
    observed_arms = has.sum(axis=-1, keepdims=True)
    plain_mean = np.divide(
        np.where(has, mean, 0.0).sum(axis=-1, keepdims=True), observed_arms,
        out=np.zeros_like(pooled_var), where=observed_arms > 0,
    )
    spread = np.divide(
        np.where(has, (mean - plain_mean) ** 2, 0.0).sum(axis=-1, keepdims=True), observed_arms - 1.0,
        out=np.full_like(pooled_var, np.inf), where=observed_arms > 1,
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        sampling = np.divide(noise_var, n, out=np.zeros_like(noise_var), where=has)
        between, prior_mean = _between_arm_variance(mean, sampling, has, spread, plain_mean)
        prior_var = np.maximum(between, 0.01 * spread)
        prior_var = np.where(np.isfinite(prior_var) & (prior_var > 0), prior_var, np.where(spread == 0, 1e-300, np.inf))
        finite_noise = np.isfinite(noise_var)
        precision = 1.0 / prior_var + np.where(finite_noise, n / noise_var, 0.0)
        posterior_mean = np.where(
            np.isfinite(prior_var),
            (prior_mean / prior_var + np.where(finite_noise, n * mean / noise_var, 0.0)) / precision,
            np.where(has, mean, prior_mean),
        )
        error = np.where(precision > 0, 1.0 / np.sqrt(precision), np.inf)
    error = np.where(finite_noise | np.isfinite(prior_var), error, np.inf)
    return Estimate(means=posterior_mean, standard_errors=error)


def _within_arm_variance(statistics: Statistics) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each arm's mean (0 without data), sum of squared deviations from it and degrees of freedom,
    shapes (..., M, K), and each metric's pooled within-arm variance (infinite without any), (..., M, 1)."""
    n = statistics.counts
    mean = np.divide(statistics.sums, n, out=np.zeros_like(statistics.sums), where=n > 0)
    centred = np.maximum(statistics.sums_of_squares - n * mean**2, 0.0)
    df = np.maximum(n - 1.0, 0.0)
    pooled_df = df.sum(axis=-1, keepdims=True)
    pooled_var = np.divide(
        centred.sum(axis=-1, keepdims=True), pooled_df, out=np.full_like(pooled_df, np.inf), where=pooled_df > 0
    )
    return mean, centred, df, pooled_var


# Newton steps on the Paule-Mandel equation at most (from the DerSimonian-Laird start: a handful).
_BETWEEN_STEPS = 50


def _between_arm_variance(mean, sampling, has, spread, plain_mean):
    """Paule-Mandel estimate of the arms' spread tau^2 and the matching prior mean; (..., M, 1) each.

    The observed arms' sample means y_k ~ N(m, tau^2 + v_k) with unequal sampling variances v_k;
    tau^2 solves Q(tau^2) = sum_k (y_k - m)^2 / (tau^2 + v_k) = (number of arms - 1), m the mean
    weighted by 1 / (tau^2 + v_k) (0 when Q(0) is already below), by Newton's method (Q is convex
    and decreasing, Q' = -sum_k (y_k - m)^2 / (tau^2 + v_k)^2). Subtracting the *average* v_k from the plain spread instead let a few arms seen once
    (v_k large) cancel the spread of the well-measured ones: the prior then shrank an unobserved
    arm so far that its upper bound never reached the best arm's, and it was never tried.
    """
    count = has.sum(axis=-1, keepdims=True)
    y = np.where(has, mean, 0.0)
    variance = np.where(has, sampling, np.inf)

    def moments(tau2):
        weights = tau2 + variance
        np.divide(1.0, weights, out=weights)  # 0 for arms without data
        total = weights.sum(axis=-1, keepdims=True)
        centre = np.divide((weights * y).sum(axis=-1, keepdims=True), total, out=plain_mean.copy(),
                           where=total > 0)
        squares = y - centre
        np.square(squares, out=squares)
        squares *= weights  # weight 0 where there is no data
        statistic = squares.sum(axis=-1, keepdims=True)
        squares *= weights
        return statistic, squares.sum(axis=-1, keepdims=True), centre

    usable = np.isfinite(spread) & (spread > 0) & (count > 1)
    # Start at the DerSimonian-Laird estimate (one moment step from the fixed-effect weights):
    # usually close; a Newton step from above the root lands below it (Q is convex), and from
    # below the steps climb without passing it.
    statistic, _, _ = moments(np.zeros_like(spread))
    weights = 1.0 / variance
    total = weights.sum(axis=-1, keepdims=True)
    scale = total - np.divide((weights**2).sum(axis=-1, keepdims=True), total, out=np.zeros_like(total),
                              where=total > 0)
    tau2 = np.where(usable, np.maximum(np.divide(statistic - (count - 1.0), scale, out=np.zeros_like(scale),
                                                 where=scale > 0), 0.0), 0.0)
    active = usable.copy()
    for _ in range(_BETWEEN_STEPS):
        statistic, slope, _ = moments(tau2)
        step = np.divide(statistic - (count - 1.0), slope, out=np.zeros_like(tau2), where=active & (slope > 0))
        moved = np.where(active, np.maximum(tau2 + step, 0.0), tau2)
        active = active & (np.abs(moved - tau2) > 1e-12 * np.maximum(moved, 1e-300))
        tau2 = moved
        if not active.any():
            break
    tau2 = np.where(usable, tau2, np.where(np.isfinite(spread), 0.0, np.inf))
    centre = moments(np.where(np.isfinite(tau2), tau2, 0.0))[2]
    return tau2, np.where(usable, centre, plain_mean)


# --------------------------------------------------------------------------- constraints


def hard_constraints(
    objective: Objective, lower: np.ndarray, upper: np.ndarray, trust_baseline: bool = True
) -> HardConstraints:
    """The hard guardrails as pessimistic rows ``A p >= c`` (module docstring, step 2).

    Parameters
    ----------
    objective : Objective
    lower, upper : ndarray, shape (..., M, K)
        Lower and upper confidence bounds of the means (both the true means for the exact problem).
    trust_baseline : bool
        Treat the baseline arm as meeting every absolute guardrail (serving) while its own upper
        bound does not refute it (``upper >= threshold``: a production setting below an absolute
        threshold, like the demo's blend-10 at like rate 0.046 against 0.06, is trusted only until
        its data say otherwise); False for the exact problem under known means.
    """
    batch = lower.shape[:-2]
    n_arms = lower.shape[-1]
    baseline = _baseline_index(objective) if trust_baseline else None
    rows, bounds, scales = [], [], []
    for guardrail in objective.guardrails:
        if not _is_hard(guardrail):
            continue
        row = objective.metrics.index(guardrail.metric)
        if guardrail.relative_to is None:
            threshold = np.full(batch, guardrail.threshold)
            coefficients = lower[..., row, :].copy()
            if baseline is not None:
                trusted = upper[..., row, baseline] >= threshold
                coefficients[..., baseline] = np.where(
                    trusted, np.maximum(coefficients[..., baseline], threshold), coefficients[..., baseline])
            rows.append(coefficients)
            bounds.append(threshold)
            scales.append(np.full(batch, abs(guardrail.threshold) or 1.0))
            continue
        reference = _arm_index(objective, guardrail.relative_to)
        factor = 1.0 + guardrail.threshold
        for bound in (upper, lower):
            coefficients = lower[..., row, :].copy()
            coefficients[..., reference] = bound[..., row, reference]
            rows.append(coefficients)
            bounds.append(factor * bound[..., row, reference])
            scales.append(np.maximum(np.abs(factor * bound[..., row, reference]), 1e-12))
    if not rows:
        empty = np.zeros(batch + (0,))
        return HardConstraints(np.zeros(batch + (0, n_arms)), empty, empty.copy())
    return HardConstraints(np.stack(rows, axis=-2), np.stack(bounds, axis=-1), np.stack(scales, axis=-1))


def served_lp(
    gains: np.ndarray, constraints: HardConstraints, fixed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """max gains . p  s.t.  A p >= c, p = fixed + (1 - sum fixed) q, q on the simplex; one run.

    Parameters
    ----------
    gains : ndarray, shape (K,)
    constraints : HardConstraints
        Unbatched (matrix (H, K)).
    fixed : ndarray, shape (K,)
        Shares carved out before optimising (min shares, holdout).

    Returns
    -------
    probabilities : ndarray, shape (K,)
    feasible : ndarray of bool, shape ()
        False when no mixture meets the constraints; the mixture with the largest worst relative
        slack (A p - c) / scale is returned then.
    """
    n_arms = gains.shape[-1]
    free = 1.0 - fixed.sum()
    matrix = constraints.matrix * free
    bounds = constraints.bounds - constraints.matrix @ fixed
    equality = np.ones((1, n_arms))
    if not constraints.count:
        q = np.zeros(n_arms)
        q[np.argmax(gains)] = 1.0
        return fixed + free * q, np.array(True)
    solved, x, _ = linear_program(-gains, -matrix, -bounds, equality, [1.0])
    if solved:
        q = np.clip(x, 0.0, None)
        q /= q.sum()
        return fixed + free * q, np.array(True)
    return largest_slack(constraints, fixed), np.array(False)


def largest_slack(constraints: HardConstraints, fixed: np.ndarray) -> np.ndarray:
    """The mixture maximising the worst relative slack min_h (A p - c)_h / scale_h; one run, (K,).

    ``p = fixed + (1 - sum fixed) q`` with q on the simplex, as in :func:`served_lp`.
    """
    n_arms = fixed.shape[-1]
    free = 1.0 - fixed.sum()
    matrix = constraints.matrix * free
    bounds = constraints.bounds - constraints.matrix @ fixed
    equality = np.ones((1, n_arms))
    scaled = matrix / constraints.scale[:, None]
    scaled_bounds = bounds / constraints.scale
    objective = np.zeros(n_arms + 1)
    objective[-1] = -1.0
    a_ub = np.hstack([-scaled, np.ones((constraints.count, 1))])
    _, x, _ = linear_program(objective, a_ub, -scaled_bounds, np.hstack([equality, [[0.0]]]), [1.0],
                             lower=np.r_[np.zeros(n_arms), -np.inf])
    q = np.clip(x[:n_arms], 0.0, None)
    q /= q.sum()
    return fixed + free * q


# --------------------------------------------------------------------------- the controller


def starting_probabilities(config: ServingConfig, objective: Objective | None, n_arms: int) -> np.ndarray:
    """p_1, the traffic before any data: the fixed shares, the rest uniform; shape (K,).

    Raises ValueError when the fixed shares cannot be served (see ``min_share`` and ``holdout``).
    """
    fixed = _fixed_shares(config, objective, n_arms)
    return fixed + (1.0 - fixed.sum()) / n_arms


def _fixed_shares(config: ServingConfig, objective: Objective | None, n_arms: int) -> np.ndarray:
    fixed = np.full(n_arms, config.min_share)
    if config.holdout > 0:
        baseline = None if objective is None else _baseline_index(objective)
        if baseline is None:
            raise ValueError("A holdout share needs a baseline arm: name one in the objective ('baseline'), "
                             "or a relative guardrail's 'relative_to' arm.")
        fixed[baseline] = max(fixed[baseline], config.holdout)
    # 1 - sum below 1e-9 is no traffic: K shares of exactly 1 / K can sum to just under 1 in floats.
    if fixed.sum() >= 1.0 - 1e-9:
        raise ValueError(
            f"The fixed shares (min_share {config.min_share} on each of {n_arms} arms, holdout "
            f"{config.holdout}) leave no traffic to optimise; their sum must stay below 1."
        )
    return fixed


# Window lengths of the change test, in blocks: a change is judged on the latest block, the latest
# 4 and the latest 16 blocks (each window starts afresh when its length is reached). A short window
# sees a large change soon; a long one has the observations a small change, or a skewed metric's
# self-normalised statistic, needs (that statistic can exceed x only with more than x^2
# observations in the window).
CHANGE_WINDOWS = (1, 4, 16)


def change_threshold(level: float, check: int, tests: int) -> float:
    """The critical value x of the ``check``-th look (1-based) of a detector of run-wide level ``level``.

    The level is spent over the looks, ``level / (j (j + 1))`` at look j (summing to ``level`` over
    an unbounded run), and split evenly over the ``tests`` statistics of a look; each statistic T
    has P(T >= x) <= 2 exp(-x^2 / 2) (:func:`change_detected`), so x = sqrt(2 ln(2 tests j (j + 1)
    / level)).
    """
    return math.sqrt(2.0 * math.log(2.0 * tests * check * (check + 1) / level))


def change_detected(evidence: Statistics, windows: list[Statistics], level: float, check: int) -> np.ndarray:
    """Per run: does some arm and metric's latest window differ from the evidence before it? Shape (...).

    For each window, arm and metric the difference D = mean(window) - mean(rest) of two independent
    samples is compared with the self-normalised scale V = [D] + <D>: [D] the observed squared
    deviations from the pooled mean, sum (x_i - m)^2 / n_side^2 over both sides, and <D> the
    expected ones, s^2 (1 / n_window + 1 / n_rest), with s^2 the metric's within-arm variance pooled
    over arms. The statistic |D| / sqrt(V) has tails no heavier than 2 exp(-x^2 / 2) (the
    self-normalised martingale inequalities of Bercu and Touati, Ann. Appl. Probab. 2008, which
    need a finite variance, not normal tails), so its level holds for skewed (log-normal),
    heavy-tailed (Student t) and rare-event (Bernoulli) metrics: one large observation raises D and
    [D] together. A normal-tail z test on the same small blocks raised a false alarm in 91% of
    stationary log-normal runs. The critical value (:func:`change_threshold`) spends ``level``
    over the looks and the window x arm x metric statistics, so that ``level`` bounds the chance
    of any false alarm in a whole run.

    Parameters
    ----------
    evidence : Statistics, shape (..., M, K)
        The evidence since the last detected change, every window included.
    windows : list of Statistics, each of shape (..., M, K)
        The observations of each window under test (the latest ones of ``evidence``).
    level : float
        Run-wide false-alarm probability, in (0, 1).
    check : int
        1-based number of this look in the run.
    """
    tests = max(1, len(windows) * int(np.prod(evidence.shape[-2:])))
    critical = change_threshold(level, check, tests)
    n = evidence.counts
    mean, _, _, variance = _within_arm_variance(evidence)
    changed = np.zeros(evidence.shape[:-2], dtype=bool)
    for window in windows:
        n_window = window.counts
        n_rest = n - n_window
        usable = (n_window >= 2) & (n_rest >= 2)
        sizes_window, sizes_rest = np.maximum(n_window, 1.0), np.maximum(n_rest, 1.0)
        rest_sums = evidence.sums - window.sums
        rest_squares = evidence.sums_of_squares - window.sums_of_squares
        difference = window.sums / sizes_window - rest_sums / sizes_rest
        # Squared deviations from the pooled mean on each side, from the sums.
        squares_window = np.maximum(window.sums_of_squares - 2.0 * mean * window.sums + n_window * mean**2, 0.0)
        squares_rest = np.maximum(rest_squares - 2.0 * mean * rest_sums + n_rest * mean**2, 0.0)
        scale = (squares_window / sizes_window**2 + squares_rest / sizes_rest**2
                 + variance * (1.0 / sizes_window + 1.0 / sizes_rest))
        with np.errstate(invalid="ignore", divide="ignore"):
            statistic = np.abs(difference) / np.sqrt(scale)
        statistic = np.where(usable & np.isfinite(statistic), statistic, 0.0)
        changed |= np.max(statistic, axis=(-2, -1)) > critical
    return changed


def choose(
    config: ServingConfig,
    objective: Objective,
    statistics: Statistics,
    round_number: int,
    log_weights: np.ndarray,
    observations_per_round: float,
    deployed: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The served and deployed mixtures for the next round, from the observations ``statistics``.

    Parameters
    ----------
    config : ServingConfig
    objective : Objective
    statistics : Statistics, shape (..., M, K)
        The evidence (since the last detected change, or all of it).
    round_number : int
        t, the round just closed (1-based).
    log_weights : ndarray, shape (..., K)
        Warm start of the plug-in solve (the previous plug-in optimum's log).
    observations_per_round : float
        Observations per run and round (n), which sets the directed exploration share 1 / (n sqrt(t)).
    deployed : ndarray, shape (..., K)
        The mixture deployed now, kept by runs whose bounds are not defined yet.
    rng : numpy.random.Generator
        Source of the posterior draws (soft guardrails); the caller derives it from the
        experiment's seed and the round, so a round's choice is reproducible and two experiments
        do not share their draws.

    Returns
    -------
    (served, deployed, log_weights), each of shape (..., K). A run whose bounds are not all defined
    (a metric with fewer than two arms with data, or no arm observed twice; after a detected change
    too) is served the uniform mixture (with the fixed shares) and keeps its deployed mixture and
    weights: with no evidence on some arm, exploring it is the only way to learn.
    """
    t = round_number
    n_arms = statistics.shape[-1]
    batch = statistics.shape[:-2]
    posterior = arm_posterior(statistics)
    means, errors = posterior.means, posterior.standard_errors
    unknown = ~np.all(np.isfinite(errors), axis=(-2, -1))  # (...)
    fixed = _fixed_shares(config, objective, n_arms)
    if unknown.all():
        uniform = np.broadcast_to(fixed + (1.0 - fixed.sum()) / n_arms, batch + (n_arms,)).copy()
        return uniform, np.asarray(deployed, dtype=float).copy(), np.asarray(log_weights, dtype=float).copy()
    if unknown.any():
        # Placeholder bounds for those runs (their results are replaced below).
        errors = np.where(np.isfinite(errors), errors, 1.0)
    z_safe = float(ndtri(config.level))
    # The hard guardrails' bounds hold for every arm at once (Bonferroni over the K arms): the LP
    # chooses among K arms and favours the one whose guardrail estimate is high by chance, so with
    # per-arm 95% bounds an arm seen 150 times at +2.5 standard errors got two thirds of the demo's
    # traffic (bench/demo_served_replica.py: 24% of 60-round runs broke the like-rate guardrail).
    z_guard = float(ndtri(1.0 - (1.0 - config.level) / n_arms))
    z_deploy = float(ndtri(config.deploy_level))
    lower, upper = means - z_guard * errors, means + z_guard * errors
    constraints = hard_constraints(objective, lower, upper)
    thresholds = objective.thresholds(means)
    weights = objective.primary_weights
    plain_gains = np.einsum("m,...mk->...k", weights, means)

    flat = int(np.prod(batch)) if batch else 1
    flat_means = means.reshape((flat,) + means.shape[-2:])
    flat_errors = errors.reshape(flat_means.shape)
    flat_thresholds = thresholds.reshape((flat,) + thresholds.shape[-1:])
    flat_counts = statistics.counts.reshape(flat_means.shape)
    served = np.empty((flat, n_arms))
    plug_in = np.empty((flat, n_arms))
    previous_log_weights = np.asarray(log_weights, dtype=float)
    log_weights = previous_log_weights.reshape((flat, n_arms)).copy()
    rows = _unbatched(constraints, flat)
    # The deployed mixture is one mixture chosen once, not a fresh pick among K arms each round on
    # the traffic users get: it keeps per-arm bounds at ``level`` (the simultaneous ones made the
    # demo's deployed mixture too timid to learn: below half the gain of mixing at 12,000 sessions
    # in 37% of runs, against 1%).
    deploy_rows = _unbatched(hard_constraints(objective, means - z_safe * errors, means + z_safe * errors), flat)
    test_errors = flat_errors
    # Hard guardrails alone take the linear path; with soft ones too, the soft path holds the hard
    # ones as constraints on the same bounds (the plug-in and the deployed mixture on the deploy
    # bounds, the served traffic padded onto the simultaneous ones).
    hard_only = bool(constraints.count) and not _has_soft_guardrails(objective)
    if hard_only:
        plain = plain_gains.reshape((flat, n_arms))
        # The reference arms of relative hard guardrails, and the rows with them known exactly
        # (their error 0): what the deployed mixture could do if their uncertainty were gone.
        references = _references(objective, hard=True)
        if references:
            known = np.empty((flat, n_arms))
            known_errors = _known_references(errors, references)
            known_rows = _unbatched(hard_constraints(objective, means - z_safe * known_errors,
                                                     means + z_safe * known_errors), flat)
        # Thompson sampling with the constraints drawn too: each posterior draw of the means is
        # solved exactly (the arms that could improve the objective or make room for others under
        # the guardrails get traffic as often as the posterior says they could) ...
        noise = _posterior_noise(rng, config.posterior_draws, means.shape[-2:])
        for run in range(flat):
            drawn = flat_means[run] + flat_errors[run] * noise  # (D, M, K)
            drawn_rows = _unbatched(hard_constraints(objective, drawn, drawn), len(noise))
            sampled = np.mean([served_lp(weights @ draw, draw_rows, fixed)[0]
                               for draw, draw_rows in zip(drawn, drawn_rows)], axis=0)
            # ... mixed with the mixture with the most pessimistic slack just enough that every
            # hard guardrail's lower bound holds (stochastic bandits with linear constraints).
            served[run] = _pad(sampled, rows[run], fixed)
            plug_in[run], _ = served_lp(plain[run], deploy_rows[run], np.zeros(n_arms))
            if references:
                known[run], _ = served_lp(plain[run], known_rows[run], np.zeros(n_arms))
        if references:
            served = _observe_references(objective, flat_means, flat_thresholds, flat_counts, served, plug_in,
                                         known, references, observations_per_round, t, rows)
        log_weights = np.log(np.maximum(plug_in, 1e-300))
    else:
        # The expected objective E f(mu p), mu ~ N(V, se^2), hedges against the steep side of a
        # soft penalty (serving too much of an arm whose guardrail estimate is too optimistic). Its
        # maximiser is solved to a certified gap, from the previous round's (:func:`expected_optimum`).
        previous = np.exp(log_weights - log_weights.max(axis=-1, keepdims=True))
        references = _references(objective, hard=False)
        known_errors = _known_references(flat_errors, references) if references else None
        known = np.empty((flat, n_arms))
        plain = plain_gains.reshape((flat, n_arms))
        for run in range(flat):
            held = None
            if constraints.count:
                # No mixture meets the hard guardrails on their deploy bounds: the one with the
                # largest worst slack, as the linear path deploys then.
                vertex, feasible = served_lp(plain[run], deploy_rows[run], np.zeros(n_arms))
                if not feasible:
                    plug_in[run] = known[run] = vertex
                    continue
                held = (deploy_rows[run].matrix, deploy_rows[run].bounds)
            plug_in[run] = expected_optimum(objective, flat_means[run], flat_errors[run], flat_thresholds[run],
                                            start=previous[run], constraints=held).probabilities
            if references:
                known[run] = expected_optimum(objective, flat_means[run], known_errors[run], flat_thresholds[run],
                                              start=plug_in[run], constraints=held).probabilities
        plug_in = _support(plug_in)
        log_weights = np.log(np.maximum(plug_in, 1e-300))
        # The standard errors rest on estimated noise variances: Student's t with the pooled degrees
        # of freedom (few observations per arm would otherwise look more certain than they are).
        degrees = np.maximum(statistics.counts - 1.0, 0.0).sum(axis=-1).min(axis=-1).reshape(flat)
        z_student = stdtrit(np.maximum(degrees, 1.0), config.deploy_level)
        # The deploy tests hold their level only if no arm looks more certain than it is. An arm's
        # own variance from a few hundred skewed observations is most often low (the tail not seen
        # yet), and low together with its mean (docs/benchmarks.md: a reference arm read 0.08 low
        # with its sample sd 0.33 against 0.5 deployed a mixture below its guardrail). The metric's
        # pooled variance rests on every arm's observations, so each test takes the larger of the
        # two standard errors: an arm whose noise is truly larger keeps its own. The posterior
        # draws keep the posterior's (pooled everywhere, they cost served regret: ibid.).
        pooled = arm_posterior(statistics, pooled_noise=True).standard_errors.reshape(flat_means.shape)
        test_errors = np.where(np.isfinite(pooled), np.maximum(flat_errors, pooled), flat_errors)
    # Streams: the best-arm draws and the posterior draws of an undecided run (soft guardrails),
    # and the deploy tests' (soft guardrails: their probabilities are estimated by drawing).
    best_arm_rng, posterior_rng, test_rng = rng.spawn(3)
    test_draws = None
    if _has_soft_guardrails(objective):
        test_draws = _deploy_test_draws(test_rng, objective, n_arms, None if hard_only else np.maximum(degrees, 1.0))
    # With soft guardrails what is served reads the delta method's test (which runs are undecided,
    # how far the start and a reference are observed) and the deployed mixture the posterior
    # probability (below). Serving on the probability's answers changed what setup B observed and
    # cost its deployed mixture more than the exact test gained (docs/benchmarks.md, "What we
    # tried"); the deployed mixture depends on the last round's statistics alone, so the exact test
    # there changes nothing that is served.
    single, arm_values, by_delta, by_probability = _defensible(
        objective, flat_means, test_errors, flat_thresholds, plug_in, deploy_rows, config.deploy_level, test_draws
    )
    deploy_defended = by_delta if by_probability is None else by_probability
    defended = deploy_defended if hard_only else by_delta
    chosen = np.where(defended[:, None], plug_in, single)
    if not hard_only:
        # What runs before pasto has learnt anything: the production setting when the objective
        # names one, else the uniform mixture (Algorithm 1's start). The deployed mixture leaves it
        # only as far as the evidence defends.
        baseline = _baseline_index(objective)
        start = np.full(n_arms, 1.0 / n_arms) if baseline is None else _one_hot(baseline, n_arms)
        start = np.broadcast_to(start, plug_in.shape)
        # Undecided: the plug-in optimum is a mixture the data cannot yet defend against the best
        # single arm. (When the plug-in is that arm itself, as with no guardrails, there is no
        # choice to hedge.)
        undecided = ~defended & (np.abs(plug_in - chosen).sum(axis=-1) > 1e-6)
        # Thompson sampling over safe mixtures: each arm is served with its posterior chance of
        # belonging to the optimal mixture times its share there, so the exploration is what the
        # posterior still allows and vanishes as it concentrates; every guardrail the plug-in
        # optimum keeps is kept in every draw, on its pessimistic bounds where the optimum keeps it
        # whatever the noise (a steep penalty) and with the plug-in's own hedge where it trades it.
        z_kept = _kept_margins(objective, flat_means, flat_errors, plug_in, z_safe)
        served, solutions = _safe_posterior_mixture(objective, flat_means, flat_errors, z_kept, plug_in,
                                                    posterior_rng, config.posterior_draws)
        if undecided.any():
            # No mixture is confidently better than the best single arm yet, so the deploy test
            # chooses between the two: half of the traffic goes where a best-arm bandit would send
            # it (each arm in proportion to its posterior probability of being the best single arm,
            # as Thompson sampling does), so that when the noise forbids a defended mixture the arm
            # deployed instead is found as fast as a best-arm bandit finds it; the other half keeps
            # the safe mixtures (the top-two Thompson split, beta = 1/2).
            best_arm = best_arm_probabilities(
                objective, flat_means, flat_errors, flat_thresholds, best_arm_rng, allowed=np.isfinite(arm_values),
            )
            # Once the posterior names the best single arm at the deploy level, the best-arm half
            # has nothing left to find, and it goes to the best known safe mixture (no draws) instead
            # of that arm: the draws' exploration stays diluted as before, by the mixture the
            # estimates favour rather than by an arm the plug-in already beats in expectation.
            identified = best_arm.max(axis=-1) >= config.deploy_level
            anchor = best_arm
            if (identified & undecided).any():
                best_known, _ = _safe_posterior_mixture(objective, flat_means, flat_errors, z_kept, plug_in,
                                                        posterior_rng, 0, solutions)
                anchor = np.where(identified[:, None], best_known, best_arm)
            served = np.where(undecided[:, None], 0.5 * anchor + 0.5 * served, served)
        served = _observe_start(objective, flat_means, test_errors, flat_thresholds, flat_counts, served,
                                chosen, start, z_student, observations_per_round, t)
        if references:
            to_defend = _reference_counts_to_defend(objective, flat_means, test_errors, flat_thresholds, plug_in,
                                                    chosen, undecided, flat_counts, references, z_deploy)
            # The served draws hold a kept guardrail against the reference's upper bound, so its
            # uncertainty costs the served traffic what the best known safe mixture loses to the
            # one it would serve with the reference known (no draws: the estimates alone).
            # Each run's problems are the posterior draws' neighbours: their last active sets are tried first.
            best_known, solutions = _safe_posterior_mixture(objective, flat_means, flat_errors, z_kept, plug_in,
                                                            posterior_rng, 0, solutions)
            with_references_known, _ = _safe_posterior_mixture(objective, flat_means, known_errors, z_kept, plug_in,
                                                               posterior_rng, 0, solutions)
            safe = (best_known, with_references_known)
            information = _reference_information(objective, flat_means, test_errors, flat_thresholds, plug_in,
                                                 references, solutions)
            served = _observe_references(objective, flat_means, flat_thresholds, flat_counts, served, plug_in,
                                         known, references, observations_per_round, t, to_defend=to_defend,
                                         safe=safe, information=information)
        served = fixed + (1.0 - fixed.sum()) * served
        # The deploy test need not be all or nothing. Along the segment from the best single arm s
        # to the plug-in mixture p the expected gain is concave in the step a while the standard
        # error of the difference grows about like a, so part of the way can be defended where p
        # is not, and keeps more than that part of the gain (a half step about three quarters of a
        # quadratic one). An undecided run's choice is s + a (p - s) with the largest a the deploy
        # test defends against s (a = 0: s itself). Only from an arm with data: an arm never observed
        # has the prior's mean, and the prior's error is 0 when the observed arms' means agree, so
        # the test would measure a step against a guess it takes for certain.
        defended = deploy_defended
        chosen = np.where(defended[:, None], plug_in, single)
        observed = np.einsum("rk,rk->r", chosen, (flat_counts.min(axis=-2) > 0).astype(float)) > 0.5
        stepping = ~defended & observed
        stepped = _conservative(objective, flat_means, test_errors, flat_thresholds, plug_in, z_deploy, chosen,
                                config.deploy_level, test_draws, runs=stepping)
        chosen = np.where(stepping[:, None], stepped, chosen)
        # The deployed mixture answers to a conservative test: what the deploy test picked (the
        # plug-in mixture, or the step towards it from the best single arm) replaces the starting
        # mixture only as far as the evidence defends it. Without it a run whose arms all look alike
        # (an arm never observed gets the pooled mean) deployed whichever arm came first, one that
        # breaks a guardrail too.
        if constraints.count:
            # A start that misses a hard guardrail's deploy bound is no status quo to defend
            # against (the linear path has none either): only the others are tested.
            start_holds = np.array([_meets(start[run], deploy_rows[run]) for run in range(flat)])
            conservative = _conservative(objective, flat_means, test_errors, flat_thresholds, chosen, z_student,
                                         start, config.deploy_level, test_draws, student=True, runs=start_holds)
            chosen = np.where(start_holds[:, None], conservative, chosen)
            # Served traffic keeps every hard guardrail on its simultaneous lower bounds, as on the
            # linear path: what the soft path moved (the best-arm half, the start and the references
            # observed) is padded with the largest-slack mixture just enough.
            for run in range(flat):
                served[run] = _pad(served[run], rows[run], fixed)
        else:
            chosen = _conservative(objective, flat_means, test_errors, flat_thresholds, chosen, z_student, start,
                                   config.deploy_level, test_draws, student=True)
    served = np.maximum(served, 0.0)
    served /= served.sum(axis=-1, keepdims=True)
    shape = batch + (n_arms,)
    served, chosen, log_weights = served.reshape(shape), chosen.reshape(shape), log_weights.reshape(shape)
    if unknown.any():
        waiting = unknown[..., None]
        served = np.where(waiting, fixed + (1.0 - fixed.sum()) / n_arms, served)
        chosen = np.where(waiting, deployed, chosen)
        log_weights = np.where(waiting, previous_log_weights, log_weights)
    return served, chosen, log_weights


# Posterior draws per run with which best_arm_probabilities estimates each arm's chance of being best.
_BEST_ARM_DRAWS = 256
# From this many arms on, best_arm_probabilities draws each run by levels (:func:`_level_draws`,
# the same distribution at a cost near K times the ~8 draws that score every arm). Below it every
# draw scores every arm as it always did, which costs no more there (39 ms either way at K = 1,000,
# against 225 and 27 ms at K = 10,000: ``python bench/serve.py best-arm``), and the learner's runs
# (at most a few hundred arms) draw exactly what they drew before.
_BEST_ARM_LEVELS_FROM = 1024
# Draws per chunk of the level path at most (the level moves between chunks only).
_BEST_ARM_LEVEL_CHUNK = 64
# Bernoulli chances below 2^-_BEST_ARM_HIT_EXPONENT are proposed at that chance (then thinned).
_BEST_ARM_HIT_EXPONENT = 60


def best_arm_probabilities(
    objective: Objective,
    means: np.ndarray,
    errors: np.ndarray,
    thresholds: np.ndarray,
    rng: np.random.Generator,
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """Posterior probability that each arm is the best single arm; (..., K).

    Thompson sampling on the arms' metric means: each of ``_BEST_ARM_DRAWS`` joint draws
    mu ~ N(means, errors^2) (every metric of every arm independent; only the metrics f reads are
    given noise) scores each arm by its own objective f(mu e_k), soft penalties included
    (:meth:`pasto.objectives.Objective.value`), and the share of draws an arm wins estimates
    P(arm k is the best), each share with a standard error of at most 0.5 / sqrt(_BEST_ARM_DRAWS)
    = 0.031 (Thompson sampling averaged over the draws, so the traffic follows the probabilities,
    not one draw). The penalty is applied to each draw, not linearised: an arm far below a
    guardrail stays out of the running however wide its primary metric's posterior (a
    delta-method normal on f(mu e_k) spread the probabilities over about 40 of setup B's 100
    arms at sigma 3.0, where this rule puts a median 0.58 on the true best arm). Every run of a
    batch uses the same standard-normal draws, so that a batched call equals per-run calls with
    generators in the same state. Arms not ``allowed`` never win; when no arm of a run is
    allowed, every arm gets 1 / K.

    From ``_BEST_ARM_LEVELS_FROM`` arms on, the runs are drawn one after the other (each from the
    generator's state at the call) by :func:`_level_draws`: the same draws' distribution, exactly,
    with most arms of most draws never scored. An arm's score is at most its primary part w . mu_k
    (the penalties are >= 0), a normal; in a draw, which arms' primary parts reach a level c is
    drawn first (independent Bernoulli trials), those arms are drawn given that they do and scored,
    and when one of them scores at least c it is the winner, since no other arm can reach c; only
    a draw none of whose arms scores c draws every arm (given it stays below c). The level is the
    lowest winning score of the draws before, so about 8 of the 256 draws score every arm.

    Parameters
    ----------
    objective : Objective
    means : ndarray, shape (..., M, K)
        Posterior means of the arms' metrics.
    errors : ndarray, shape (..., M, K)
        Posterior standard deviations (>= 0, finite).
    thresholds : ndarray, shape (..., G)
        Resolved guardrail thresholds (:meth:`pasto.objectives.Objective.thresholds`).
    rng : numpy.random.Generator
    allowed : ndarray of bool, shape (..., K), optional
        Arms that may win (all by default).

    Returns
    -------
    ndarray, shape (..., K)
        Probabilities summing to 1 along the last axis.
    """
    means = np.asarray(means, dtype=float)
    errors = np.asarray(errors, dtype=float)
    batch = means.shape[:-2]
    n_metrics, n_arms = means.shape[-2:]
    flat = int(np.prod(batch)) if batch else 1
    flat_means = means.reshape((flat, n_metrics, n_arms))
    flat_errors = errors.reshape((flat, n_metrics, n_arms))
    flat_thresholds = np.broadcast_to(thresholds, batch + np.shape(thresholds)[-1:]).reshape((flat, -1))
    flat_allowed = (
        np.ones((flat, n_arms), dtype=bool) if allowed is None
        else np.broadcast_to(allowed, batch + (n_arms,)).reshape((flat, n_arms))
    )
    # Only the metrics f reads get noise: the primary metrics and the soft guardrails' rows (a hard
    # guardrail's arms are excluded through ``allowed``, and its penalty is 0); the others stay at
    # their means, so Objective.value scores every draw.
    read = (objective.primary_weights != 0) | np.isin(np.arange(n_metrics), objective.guardrail_rows[objective.penalties > 0])
    used = np.flatnonzero(read)
    arm_means = np.swapaxes(flat_means, -1, -2)  # (R, K, M)
    arm_errors = np.swapaxes(flat_errors, -1, -2)[..., used]  # (R, K, U)
    wins = np.zeros((flat, n_arms))
    if n_arms >= _BEST_ARM_LEVELS_FROM:
        state = rng.bit_generator.state
        for run in range(flat):
            if flat_allowed[run].any():
                rng.bit_generator.state = state
                wins[run] = _level_draws(objective, flat_means[run], flat_errors[run], flat_thresholds[run],
                                         flat_allowed[run], rng)
        shares = wins / _BEST_ARM_DRAWS
        shares = np.where(flat_allowed.any(axis=-1, keepdims=True), shares, 1.0 / n_arms)
        return shares.reshape(batch + (n_arms,))
    # Draws in chunks and runs in blocks, so that the drawn metric vectors stay near 2^16 values
    # (one draw of K = 10,000 arms and 5 metrics is 50,000); the chunks take the generator's
    # normals in the order one (draws, K, U) call would.
    chunk = int(np.clip((1 << 16) // (n_metrics * n_arms), 1, _BEST_ARM_DRAWS))
    block = max(1, (1 << 16) // (chunk * n_metrics * n_arms))
    for first in range(0, _BEST_ARM_DRAWS, chunk):
        noise = rng.standard_normal((min(chunk, _BEST_ARM_DRAWS - first), n_arms, used.size))
        for start in range(0, flat, block):
            stop = min(flat, start + block)
            drawn = np.repeat(arm_means[start:stop, None], noise.shape[0], axis=1)  # (b, S, K, M)
            drawn[..., used] += arm_errors[start:stop, None] * noise[None]
            scores = objective.value(drawn, flat_thresholds[start:stop, None, None, :])  # (b, S, K)
            scores = np.where(flat_allowed[start:stop, None, :], scores, -np.inf)
            winners = np.argmax(scores, axis=-1)  # (b, S)
            np.add.at(wins, (np.arange(start, stop)[:, None], winners), 1.0)
    shares = wins / _BEST_ARM_DRAWS
    shares = np.where(flat_allowed.any(axis=-1, keepdims=True), shares, 1.0 / n_arms)
    return shares.reshape(batch + (n_arms,))


def _bernoulli_hits(chances: np.ndarray, draws: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Independent Bernoulli(``chances``_k) trials for every (draw, arm) of ``draws`` x K; the
    successes as (draws index, arm index) arrays, at a cost near their number plus 61 groups.

    Arms are grouped by p = 2^-e >= chance > p / 2 (e = floor(-log2 chance), at most
    ``_BEST_ARM_HIT_EXPONENT``); a group's draws x arms trials at chance p are placed by geometric
    gaps, and each success is kept with probability chance / p (thinning), which leaves every
    trial a success with probability chance, independently.
    """
    positive = np.flatnonzero(chances > 0)
    if positive.size == 0:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    with np.errstate(divide="ignore"):
        exponents = np.minimum(np.floor(-np.log2(chances[positive])), _BEST_ARM_HIT_EXPONENT).astype(np.intp)
    # The exponents are 0 to _BEST_ARM_HIT_EXPONENT: a stable sort of them as bytes (a radix sort)
    # gives the same order as one of the intp values, several times faster.
    order = np.argsort(exponents.astype(np.int8), kind="stable")
    ordered = exponents[order]
    starts = np.flatnonzero(np.append(True, ordered[1:] != ordered[:-1]))
    groups = ordered[starts]
    ends = np.append(starts[1:], order.size)
    draw_parts, arm_parts = [], []
    for exponent, first, last in zip(groups.tolist(), starts.tolist(), ends.tolist()):
        trials, chance = draws * (last - first), 2.0 ** -float(exponent)
        if exponent == 0:
            positions = np.arange(trials)
        else:
            expected = trials * chance
            size = int(expected + 6.0 * math.sqrt(expected) + 16.0)
            # A gap past the last trial ends the group: clipped there, the sums cannot overflow.
            gaps = rng.geometric(chance, size)
            if gaps[0] > trials:
                continue  # no success in the group (most groups of small chances): nothing more to draw
            positions = np.cumsum(np.minimum(gaps, trials + 1)) - 1
            while positions[-1] < trials:
                more = np.cumsum(np.minimum(rng.geometric(chance, size), trials + 1)) + positions[-1]
                positions = np.concatenate([positions, more])
            positions = positions[positions < trials]
        members = positive[order[first:last]]
        arms = members[positions % members.size]
        kept = rng.random(positions.size) * chance < chances[arms]
        draw_parts.append(positions[kept] // members.size)
        arm_parts.append(arms[kept])
    if not draw_parts:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    return np.concatenate(draw_parts), np.concatenate(arm_parts)


def _level_draws(objective: Objective, means: np.ndarray, errors: np.ndarray, thresholds: np.ndarray,
                 allowed: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Wins of each arm in ``_BEST_ARM_DRAWS`` draws of one run (means, errors (M, K)); (K,).

    The draws of :func:`best_arm_probabilities` (mu ~ N(means, errors^2), each allowed arm
    scored by f(mu e_k), the best wins), drawn in another order with the same distribution:

    - Arm k's primary part U_k = w . mu_k is N(a_k, b_k^2), and f(mu e_k) = U_k - (soft
      penalties) <= U_k; the penalties read metrics U does not sum (a metric is either maximised
      or guarded), independent of it, so only U_k's distribution changes below.
    - For a level c fixed before the draw, whether U_k >= c (chance q_k) is drawn for every arm
      (:func:`_bernoulli_hits`), and the arms where it holds are drawn given it (U_k from its
      upper tail by the inverse normal CDF) and scored. When the best of them scores c or more,
      it is the draw's winner: every other arm scores at most U_k < c. Otherwise every other arm
      is drawn given U_k < c, and the best of all wins.
    - c is the lowest winning score of the draws before (none at first: the first draw scores
      every arm), and it moves between chunks of draws that double up to
      ``_BEST_ARM_LEVEL_CHUNK``; about 8 of the 256 draws score every arm.
    """
    arms = np.flatnonzero(allowed)
    means, errors = means[:, arms], errors[:, arms]
    weights = objective.primary_weights
    soft = objective.penalties > 0
    rows, penalties = objective.guardrail_rows[soft], objective.penalties[soft]
    levels = np.asarray(thresholds, dtype=float)[soft]
    guarded = np.unique(rows)  # never a primary metric (Objective refuses a guarded primary metric)
    primary = np.flatnonzero(weights != 0)
    upper_means = weights[primary] @ means[primary]
    upper_errors = np.sqrt(weights[primary] ** 2 @ errors[primary] ** 2)

    def scores(draw_arms: np.ndarray | None, upper_z: np.ndarray) -> np.ndarray:
        """Scores of arms ``draw_arms`` (None: every arm) given their standardised primary parts ``upper_z``."""
        def pick(values: np.ndarray) -> np.ndarray:
            return values if draw_arms is None else values[draw_arms]

        b = pick(upper_errors)
        value = pick(upper_means) + np.where(b > 0, b * upper_z, 0.0)
        x = {row: pick(means[row]) + pick(errors[row]) * rng.standard_normal(upper_z.size) for row in guarded}
        for row, lam, level in zip(rows, penalties, levels):
            short = np.minimum(x[row] - level, 0.0)
            value = value - lam * short * short
        return value

    def uniform(size: int) -> np.ndarray:
        return 1.0 - rng.random(size)  # in (0, 1]

    wins = np.zeros(means.shape[1])
    level, above, below = np.inf, np.zeros(arms.size), np.ones(arms.size)
    done = 0
    while done < _BEST_ARM_DRAWS:
        count = int(min(max(done, 1), _BEST_ARM_LEVEL_CHUNK, _BEST_ARM_DRAWS - done))
        hit_draws, hit_arms = _bernoulli_hits(above, count, rng)
        hit_values = scores(hit_arms, -ndtri(uniform(hit_arms.size) * above[hit_arms]))
        top = np.full(count, -np.inf)
        winners = np.full(count, -1, dtype=np.intp)
        if hit_arms.size:
            order = np.lexsort((hit_values, hit_draws))
            last = np.flatnonzero(np.append(hit_draws[order][1:] != hit_draws[order][:-1], True))
            best = order[last]
            top[hit_draws[best]], winners[hit_draws[best]] = hit_values[best], hit_arms[best]
        for draw in np.flatnonzero(~(top >= level)):
            hits_of_draw = hit_arms[hit_draws == draw]
            if hits_of_draw.size:
                others = np.ones(arms.size, dtype=bool)
                others[hits_of_draw] = False
                other_arms = np.flatnonzero(others)
                values = scores(other_arms, ndtri(uniform(other_arms.size) * below[other_arms]))
            else:
                other_arms = None  # every arm, without indexing each array by all of them
                values = scores(None, ndtri(uniform(arms.size) * below))
            if values.size and not (values.max() <= top[draw]):
                best_other = int(np.nanargmax(values)) if np.isfinite(values).any() else 0
                top[draw] = values[best_other]
                winners[draw] = best_other if other_arms is None else other_arms[best_other]
        np.add.at(wins, winners[winners >= 0], 1.0)
        done += count
        lowest = float(np.min(top))
        if np.isfinite(lowest) and lowest < level:
            level = lowest
            with np.errstate(divide="ignore", invalid="ignore"):
                standard = (upper_means - level) / upper_errors
            above = np.where(upper_errors > 0, ndtr(standard), (upper_means >= level).astype(float))
            below = np.where(upper_errors > 0, ndtr(-standard), (upper_means < level).astype(float))
            bad = ~np.isfinite(above) | ~np.isfinite(below)
            if bad.any():
                above, below = np.where(bad, 0.0, above), np.where(bad, 1.0, below)
    full = np.zeros(allowed.shape[0])
    full[arms] = wins
    return full


def _references(objective: Objective, hard: bool) -> list[tuple[int, int]]:
    """(metric row, reference arm) of every relative guardrail, hard ones or soft ones."""
    return [(objective.metrics.index(g.metric), _arm_index(objective, g.relative_to))
            for g in objective.guardrails if _is_hard(g) == hard and g.relative_to is not None]


def _known_references(errors: np.ndarray, references: list[tuple[int, int]]) -> np.ndarray:
    """``errors`` with the reference arms' entries 0: as if their means were known exactly."""
    known = errors.copy()
    for row, reference in references:
        known[..., row, reference] = 0.0
    return known


def _support(mixture: np.ndarray) -> np.ndarray:
    """A plug-in mixture (R, K) with the shares below its precision set to 0, renormalised."""
    mixture = np.where(mixture < _NEGLIGIBLE * mixture.max(axis=-1, keepdims=True), 0.0, mixture)
    return mixture / mixture.sum(axis=-1, keepdims=True)


def _reference_counts_to_defend(objective, means, errors, thresholds, mixture, single, undecided, counts,
                                references, z):
    """Observations of each reference arm with which an undecided run's mixture would be defended; (R, J).

    An undecided run's plug-in mixture is not yet confidently better than the best single arm
    (:func:`_defensible`): its advantage a (posterior expected objective) is below ``z`` standard
    errors of the difference. A relative threshold's reference arm enters that difference's
    variance through the threshold, with a part P that shrinks like 1 / n in its n observations.
    If the estimates hold, n' = n P / ((a / z)^2 - V0) observations of it (V0: the variance of
    the rest) defend the mixture; when the rest alone is too uncertain (V0 >= (a / z)^2) or
    nothing is undecided, observing the reference cannot decide it: 0 (no demand).
    Returns (R, J) for the J ``references``, (0 where there is no demand); the advantage a (R,).
    """
    x = np.einsum("rmk,rk->rm", means, mixture)
    value = _expected_soft_value(objective, x, _guardrail_variance(objective, errors, mixture), thresholds)
    x_single = np.einsum("rmk,rk->rm", means, single)
    single_value = _expected_soft_value(objective, x_single, _guardrail_variance(objective, errors, single), thresholds)
    advantage = value - single_value
    total = _difference_error(objective, means, errors, thresholds, mixture, single) ** 2
    target = (np.maximum(advantage, 0.0) / z) ** 2
    wanted = np.zeros((means.shape[0], len(references)))
    for j, (row, reference) in enumerate(references):
        without = errors.copy()
        without[:, row, reference] = 0.0
        rest = _difference_error(objective, means, without, thresholds, mixture, single) ** 2
        part = total - rest
        n = counts[:, row, reference]
        possible = undecided & (advantage > 0) & (target > rest) & (part > 0)
        wanted[:, j] = np.where(possible, n * part / np.where(possible, target - rest, 1.0), 0.0)
    return wanted, advantage


def _reference_information(objective, means, errors, thresholds, plug_in, references, warm_starts=None):
    """Expected loss per observation of ``plug_in`` (R, K) from each reference arm's estimation error; (R, J).

    A relative threshold moves with its reference arm's estimate, and so does the mixture that is
    best for it: acting on an estimate off by d loses L(d) = f_d(p_d) - f_d(p) per observation,
    with f_d the objective with the reference's mean moved by d and p_d its exact optimum
    (:func:`pasto.optimum.solve`). Where the optimum moves smoothly with the threshold (a soft
    guardrail's quadratic penalty, its active set unchanged), L is quadratic in d, so the value of
    knowing the reference, its posterior expectation less L(0) (the plug-in's own hedge, which the
    reference's error does not cause), is (L(se) + L(-se)) / 2 - L(0) (the sigma points of
    d ~ N(0, se^2), exact for a quadratic). It shrinks like 1 / n in the reference's n
    observations. ``warm_starts`` (R,), optional: a solution of a nearby problem per run, whose
    active set the first solve tries (the same optimum, found without HiGHS where it holds).
    """
    information = np.zeros((means.shape[0], len(references)))
    for run in range(means.shape[0]):
        def loss(shifted, warm_start=None):
            shifted_thresholds = objective.thresholds(shifted)
            solution = solve(objective, shifted, shifted_thresholds, warm_start=warm_start)
            return (objective.value(shifted @ solution.probabilities, shifted_thresholds)
                    - objective.value(shifted @ plug_in[run], shifted_thresholds)), solution

        centre, solution = loss(means[run], None if warm_starts is None else warm_starts[run])
        for j, (row, reference) in enumerate(references):
            sides = []
            for sign in (1.0, -1.0):
                shifted = means[run].copy()
                shifted[row, reference] += sign * errors[run, row, reference]
                # A side is the centre's problem with one reference mean moved: its active set is tried first.
                sides.append(loss(shifted, solution)[0])
            information[run, j] = max(0.5 * (sides[0] + sides[1]) - centre, 0.0)
    return information


def _observe_references(objective, means, thresholds, counts, served, plug_in, known, references,
                        observations_per_round, t, rows=None, to_defend=None, safe=None, information=None):
    """``served`` (R, K) with a share moved to the reference arms of relative guardrails.

    A relative guardrail's threshold rests on its reference arm's estimate, which the chosen
    mixture must hedge against (an upper bound for a hard guardrail, the slack's variance in the
    expected objective for a soft one). That uncertainty costs C = f(mu p_known) - f(mu p) per
    served observation, with p_known the mixture chosen were the reference known exactly (both
    valued on the estimates). C shrinks like 1 / sqrt(n) in the reference's observations n, so one
    more observation saves C / (2 n) on each observation still to come, and observing the
    reference instead of the chosen mixture costs D = grad f(mu p) . (mu p - mu_ref). With as many
    observations still to come as have been made (Q t: the doubling horizon), the reference is
    worth observing until n = Q t C / (2 D). The deficit is spread over that horizon: the
    reference's share of the round is (n_wanted - n) / (Q t), at most the whole round, and at most
    what keeps every guardrail the served mixture keeps on the estimates; a share that would break
    a hard guardrail's bound (``rows``, one per run) is not served. ``safe`` (a pair of (R, K)
    mixtures: the served path's best known safe mixture, and the same with the references known)
    adds the served traffic's own cost: C is the larger of the two losses. ``information`` (R, J)
    adds the cost of acting on the reference's estimate (:func:`_reference_information`): an
    expected loss I per observation that shrinks like 1 / n, so one more observation saves I / n
    on each observation still to come, worth it until n = sqrt(Q t I n / D); the reference is
    observed to the larger of the two counts.
    """
    def loss(mixture, mixture_known):
        hedged, exact = (np.einsum("rmk,rk->rm", means, m) for m in (mixture, mixture_known))
        return objective.value(exact, thresholds) - objective.value(hedged, thresholds)

    cost = loss(plug_in, known) if safe is None else np.maximum(loss(plug_in, known), loss(*safe))
    x = np.einsum("rmk,rk->rm", means, plug_in)
    gradient = objective.gradient(x, thresholds)
    per_round = max(observations_per_round, 1.0)
    served = served.copy()
    for row, reference in references:
        price = np.einsum("rm,rm->r", gradient, x - means[..., reference])
        wanted = per_round * t * cost / (2.0 * np.where(price > 0, price, 1.0))
        valued = cost > 0
        if information is not None:
            expected_loss = information[:, references.index((row, reference))]
            seen = np.maximum(counts[:, row, reference], 1.0)
            wanted = np.maximum(wanted, np.sqrt(per_round * t * expected_loss * seen
                                                / np.where(price > 0, price, 1.0)))
            valued = valued | (expected_loss > 0)
        if to_defend is not None:
            # The deploy test's need: observing the reference to n' (the mixture defended) is worth
            # it when the mixture's advantage over the horizon (t rounds) exceeds what the
            # observations cost (price / Q each).
            needed, advantage = to_defend[0][:, references.index((row, reference))], to_defend[1]
            worth = t * advantage >= (needed - counts[:, row, reference]) * price / per_round
            wanted = np.where((needed > 0) & worth, np.maximum(wanted, needed), wanted)
            valued = valued | ((needed > 0) & worth)
        share = np.clip((wanted - counts[:, row, reference]) / (per_round * t), 0.0, 1.0)
        # A reference no worse than the chosen mixture (D <= 0) is in its support already.
        share = np.where(valued & (price > 0), np.maximum(share - served[:, reference], 0.0), 0.0)
        # No guardrail that the served mixture keeps on the estimates is broken by the move.
        shares = np.zeros_like(served)
        shares[:, reference] = share
        moved = _moved_to(objective, means, thresholds, served, shares)
        if rows is not None:
            keeps = np.array([_meets(moved[run], rows[run]) for run in range(len(rows))])
            moved = np.where(keeps[:, None], moved, served)
        served = moved
    return served


def _meets(mixture: np.ndarray, constraints: HardConstraints) -> bool:
    """Whether ``A p >= c`` holds for the mixture (K,) on every row: :func:`_pad`'s first test."""
    return bool(np.all(constraints.matrix @ mixture - constraints.bounds >= 0))


def _pad(mixture: np.ndarray, constraints: HardConstraints, fixed: np.ndarray) -> np.ndarray:
    """(1 - a) mixture + a safe with the smallest a in [0, 1] meeting ``A p >= c``, (K,), a row the
    safe mixture holds with less than ``HOLD_TOLERANCE`` of its scale relaxed by the difference.

    ``safe`` is the largest-slack mixture (:func:`largest_slack` with the shares ``fixed``),
    solved only when ``mixture`` misses a row. When even ``safe`` misses a row (nothing is known
    to be feasible), ``mixture`` is returned: there is nothing safer to pad with, and exploring is
    the way to find out. (Serving ``safe``
    instead kept setup-b-hard's runs on a largest-slack mixture that broke a guardrail, never
    learning the other arms: served hold 0.65 instead of 0.99 after round 20.)
    """
    if _meets(mixture, constraints):
        return mixture
    safe = largest_slack(constraints, fixed)
    margin = constraints.matrix @ safe - constraints.bounds
    if np.any(margin < 0):
        return mixture
    # Room to learn in: a row the safest mixture holds with less slack than HOLD_TOLERANCE of its
    # scale (a guardrail is judged held to that) is relaxed by the difference. Padded onto the bare
    # bound, a baseline with no slack (its own relative guardrail's reference at threshold 0, or on
    # an absolute threshold) took the whole round, no other arm was observed again, and their
    # bounds never rose: the run served the baseline for ever. Rows with that much slack are as before.
    room = np.maximum(HOLD_TOLERANCE * constraints.scale - margin, 0.0)
    have = constraints.matrix @ mixture - constraints.bounds + room
    if np.all(have >= 0):
        return mixture
    margin = margin + room
    short = have < 0
    share = np.max(-have[short] / (margin[short] - have[short]))
    share = min(1.0, share * (1.0 + 1e-9) + 1e-12)
    return (1.0 - share) * mixture + share * safe


def _unbatched(constraints: HardConstraints, flat: int) -> list[HardConstraints]:
    """One ``HardConstraints`` per run (leading batch dimensions flattened to ``flat``)."""
    return [HardConstraints(m, b, s) for m, b, s in zip(
        constraints.matrix.reshape((flat,) + constraints.matrix.shape[-2:]),
        constraints.bounds.reshape((flat, -1)),
        constraints.scale.reshape((flat, -1)),
    )]


def _guardrail_variance(objective: Objective, errors: np.ndarray, mixture: np.ndarray) -> np.ndarray:
    """Var of each guardrail's slack y_j - c_j at ``mixture`` under the posterior; (..., G).

    errors (..., M, K), mixture (..., K). The slack is a linear form in the arms' means,
    sum_k (p_k - w_jk) mu[g_j, k], with w_j the threshold's weights on the reference arm
    (:meth:`pasto.objectives.Objective.threshold_weights`: 1 + theta on it for a relative
    guardrail, 0 for an absolute one), so the reference arm's own uncertainty enters every bound:
    a threshold estimated from a rarely served reference is as uncertain as it is.
    """
    weights = objective.threshold_weights(mixture.shape[-1])  # (G, K)
    variance = errors[..., objective.guardrail_rows, :] ** 2  # (..., G, K)
    return _slack_variance(mixture, weights, variance)


def _slack_variance(mixture: np.ndarray, weights: np.ndarray, variance: np.ndarray) -> np.ndarray:
    """:func:`_guardrail_variance` from the threshold weights (G, K) and the guarded rows' variances
    (..., G, K), for a caller that evaluates many mixtures on the same posterior."""
    terms = mixture[..., None, :] - weights
    np.square(terms, out=terms)
    if np.broadcast_shapes(terms.shape, variance.shape) == terms.shape:
        terms *= variance
    else:
        terms = terms * variance
    return np.sum(terms, axis=-1)


def _expected_soft_value(objective: Objective, x: np.ndarray, variance: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """E f without the hard guardrails when each slack y_j - c_j ~ N(x_gj - c_j, variance_j).

    x (..., M), variance (..., G) (:func:`_guardrail_variance`), thresholds (..., G). The primary
    part is linear; soft guardrail j contributes -lambda_j E min(0, S_j)^2 with
    E min(0, S)^2 = (d^2 + s^2) Phi(-d/s) - d s phi(d/s), d = E S, s = sd S.
    """
    soft = np.array([not _is_hard(g) for g in objective.guardrails], dtype=bool)
    value = x @ objective.primary_weights
    if soft.any():
        rows = objective.guardrail_rows[soft]
        d = x[..., rows] - thresholds[..., soft]
        sd = np.sqrt(np.maximum(variance[..., soft], 0.0))
        uncertain = sd > 1e-300
        ratio = np.where(uncertain, d / np.where(uncertain, sd, 1.0), 0.0)
        tail = (d**2 + sd**2) * ndtr(-ratio) - d * sd * np.exp(-0.5 * ratio**2) / math.sqrt(2.0 * math.pi)
        shortfall = np.where(uncertain, tail, np.minimum(0.0, d) ** 2)
        value = value - np.sum(objective.penalties[soft] * shortfall, axis=-1)
    return value


def _difference_error(objective, means, errors, thresholds, first, second):
    """Delta-method standard error of f(V first) - f(V second) under the posterior; (R,).

    means, errors (R, M, K), thresholds (R, G), first and second (R, K). Entry (m, k) of V enters
    with coefficient df/dx_m(first) first_k - df/dx_m(second) second_k, and through a relative
    threshold c_j = w_j . V[g_j] also with w_jk (df/dc_j(first) - df/dc_j(second)), where
    df/dc_j = 2 lambda_j min(0, y_j - c_j).
    """
    weights = objective.threshold_weights(means.shape[-1])  # (G, K)
    return _difference_error_against(objective, means, errors**2, thresholds, weights, first,
                                     _reference_side(objective, means, thresholds, second))


def _sensitivities(objective, means, thresholds, mixture, x=None):
    """df/dx (R, M) and df/dc_j (R, G) at ``mixture`` (R, K); ``x`` = V mixture when known."""
    if x is None:
        x = np.einsum("rmk,rk->rm", means, mixture)
    shortfall = np.minimum(0.0, x[..., objective.guardrail_rows] - thresholds)
    return objective.gradient(x, thresholds), 2.0 * objective.penalties * shortfall


def _reference_side(objective, means, thresholds, second, x=None):
    """What :func:`_difference_error` needs of its second mixture: its part of the coefficients
    (R, M, K) and its df/dc_j (R, G); computed once for a mixture compared many times."""
    gradient_second, by_threshold_second = _sensitivities(objective, means, thresholds, second, x)
    return gradient_second[:, :, None] * second[:, None, :], by_threshold_second


def _difference_error_against(objective, means, squared_errors, thresholds, weights, first, reference, x=None):
    """:func:`_difference_error` of ``first`` against a mixture prepared by :func:`_reference_side`,
    with the squared errors (R, M, K) and threshold weights (G, K) given."""
    second_part, by_threshold_second = reference
    gradient_first, by_threshold_first = _sensitivities(objective, means, thresholds, first, x)
    coefficient = gradient_first[:, :, None] * first[:, None, :]
    coefficient -= second_part
    if np.any(weights):
        through_threshold = (by_threshold_first - by_threshold_second)[:, :, None] * weights  # (R, G, K)
        np.add.at(coefficient, (slice(None), objective.guardrail_rows), through_threshold)
    np.square(coefficient, out=coefficient)
    coefficient *= squared_errors
    return np.sqrt(np.sum(coefficient, axis=(-2, -1)))


def _one_hot(index: np.ndarray, n_arms: int) -> np.ndarray:
    """Rows e_index, (..., K): one arm each (never a K x K identity)."""
    index = np.asarray(index)
    rows = np.zeros(index.shape + (n_arms,))
    np.put_along_axis(rows, index[..., None], 1.0, axis=-1)
    return rows


# Posterior draws with which the deploy tests estimate a probability under soft guardrails: about
# +-0.0034 (one standard error) at 0.95. One set per round serves every test of that round, so the
# steps of one test are judged on one sample.
_DEPLOY_TEST_DRAWS = 4096


def _has_soft_guardrails(objective: Objective) -> bool:
    return any(not _is_hard(g) for g in objective.guardrails)


def _reference_entries(objective: Objective, n_arms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries (row, arm) of V that relative thresholds rest on, (J,) each, and each
    threshold's weight on them, (G, J): c = c0 + link . V[rows, arms]."""
    weights = objective.threshold_weights(n_arms)  # (G, K)
    guards, arms = np.nonzero(weights)
    entries = sorted(set(zip(objective.guardrail_rows[guards].tolist(), arms.tolist())))
    rows = np.array([row for row, _ in entries], dtype=int)
    columns = np.array([arm for _, arm in entries], dtype=int)
    link = np.zeros((len(objective.guardrails), len(entries)))
    for j, (row, arm) in enumerate(entries):
        on_row = objective.guardrail_rows == row
        link[on_row, j] = weights[on_row, arm]
    return rows, columns, link


@dataclass(frozen=True)
class _TestDraws:
    """One round's draws for :func:`_probability_better`, with what every test of the round shares.

    normal (D, 2M + J) standard normals; scales (R, D) Student-t scales sqrt(degrees / chi-square)
    or None; rows, columns (J,) and link (G, J) from :func:`_reference_entries`; base (G,) the
    thresholds' constant parts (the relative ones 0).
    """

    normal: np.ndarray
    scales: np.ndarray | None
    rows: np.ndarray
    columns: np.ndarray
    link: np.ndarray
    base: np.ndarray

    def of_runs(self, runs: np.ndarray) -> _TestDraws:
        """The same draws for the runs ``runs`` only (their scales)."""
        return dataclasses.replace(self, scales=None if self.scales is None else self.scales[runs])


def _deploy_test_draws(rng: np.random.Generator, objective: Objective, n_arms: int,
                       degrees: np.ndarray | None = None) -> _TestDraws:
    """The draws of :func:`_probability_better` for one round: standard normals (D, 2M + J) and,
    with ``degrees`` (R,), each run's Student-t scales sqrt(degrees / chi-square), (R, D)."""
    rows, columns, link = _reference_entries(objective, n_arms)
    normal = rng.standard_normal((_DEPLOY_TEST_DRAWS, 2 * objective.n_metrics + len(rows)))
    scales = None
    if degrees is not None:
        # Every run of a batch draws what it would draw alone (the simulator's batches decide what
        # the service decides): each run's chi-square draws start from the same generator state.
        freedom = np.asarray(degrees, dtype=float)
        scales = np.empty((freedom.shape[0], _DEPLOY_TEST_DRAWS))
        state = rng.bit_generator.state
        for run, run_freedom in enumerate(freedom):
            rng.bit_generator.state = state
            scales[run] = np.sqrt(run_freedom / rng.chisquare(run_freedom, _DEPLOY_TEST_DRAWS))
    base = objective.thresholds(np.zeros((objective.n_metrics, n_arms)))
    return _TestDraws(normal, scales, rows, columns, link, base)


def _probability_better(objective, means, errors, first, second, draws, student=False):
    """P(f(V first) > f(V second)) for V ~ N(means, errors^2) entry by entry; (R,).

    means, errors (R, M, K); first, second (R, K); ``draws`` from :func:`_deploy_test_draws`.
    With soft guardrails f has a kink where a slack crosses 0, and the delta method
    (:func:`_difference_error`) sees only its first derivative there, which is 0: two mixtures at a
    guardrail's estimated threshold looked as certain as their primary metric however uncertain
    the threshold (a reference arm seen 196 times, its estimate 1.8 standard errors low: a step
    to a mixture on the estimated threshold was "defended" and lost 0.016 under the truth). The
    difference depends on V only through x1 = V first, x2 = V second (M each) and the reference
    entries of relative thresholds (J), jointly normal with a covariance built in O(M K); the
    probability is the share of D draws of that (2M + J)-vector in which f(x1) > f(x2), exact
    but for the draws' own noise. With ``student`` each draw's deviation is scaled by the draws'
    Student-t scales: Student's t, as the start test's z.
    """
    runs, n_metrics, _ = means.shape
    rows, columns, link = draws.rows, draws.columns, draws.link
    size = 2 * n_metrics + len(rows)
    variance = errors**2
    covariance = np.zeros((runs, size, size))
    metric = np.arange(n_metrics)
    both = n_metrics + metric
    covariance[:, metric, metric] = np.einsum("rk,rmk->rm", first**2, variance)
    covariance[:, both, both] = np.einsum("rk,rmk->rm", second**2, variance)
    covariance[:, metric, both] = covariance[:, both, metric] = np.einsum("rk,rmk->rm", first * second, variance)
    if len(rows):
        entry = 2 * n_metrics + np.arange(len(rows))
        own = variance[:, rows, columns]  # (R, J)
        covariance[:, entry, entry] = own
        covariance[:, rows, entry] = covariance[:, entry, rows] = first[:, columns] * own
        covariance[:, n_metrics + rows, entry] = covariance[:, entry, n_metrics + rows] = second[:, columns] * own
    centre = np.concatenate([np.einsum("rmk,rk->rm", means, first), np.einsum("rmk,rk->rm", means, second),
                             means[:, rows, columns]], axis=-1)  # (R, 2M + J)
    eigenvalues, eigenvectors = np.linalg.eigh(covariance)
    factor = eigenvectors * np.sqrt(np.maximum(eigenvalues, 0.0))[:, None, :]  # covariance = factor factor'
    deviation = draws.normal @ np.swapaxes(factor, -1, -2)  # (R, D, 2M + J)
    if student:
        deviation *= draws.scales[:, :, None]
    drawn = np.add(deviation, centre[:, None, :], out=deviation)  # in place: the draws are D x larger than V
    # Without relative thresholds (J = 0) every draw's thresholds are the constant ones.
    thresholds = draws.base + drawn[..., 2 * n_metrics:] @ link.T if len(rows) else draws.base  # (R, D, G) or (G,)
    better = (objective.value(drawn[..., :n_metrics], thresholds)
              > objective.value(drawn[..., n_metrics:2 * n_metrics], thresholds))
    return better.mean(axis=-1)


# Steps from the starting mixture towards the plug-in optimum tried by _conservative.
_CONSERVATIVE_STEPS = np.linspace(0.0, 1.0, 11)


def _conservative(objective, means, errors, thresholds, target, z, start, level=None, draws=None, student=False,
                  runs=None):
    """Move from the mixture ``start`` towards ``target`` only as far as the evidence defends; (R, K).

    Conservative bandits (Wu et al., ICML 2016): p0 = ``start`` (R, K) is what stays if nothing is
    defended (:func:`choose` anchors it at the best single arm, to step towards an undefended
    plug-in mixture, then at what a team runs before pasto learns anything: the baseline arm,
    else uniform). The result is p0 + a (target - p0) with the largest a in {0, 0.1, ..., 1} whose
    posterior expected objective beats p0's by ``z`` standard errors of the difference (delta
    method), or a = 0. With ``draws`` (soft guardrails), a step is defended when it
    beats p0 with posterior probability above ``level`` instead (:func:`_probability_better`;
    Student's t with ``student``, as ``z`` is then). With little data the deployed
    mixture stays at p0 instead of following a plug-in optimum that the noise moves around; a good
    plug-in optimum is deployed as soon as it is confidently better. Returns the mixture (R, K).
    With ``draws``, only the runs ``runs`` (R,) bool (default all) are tested: the others, and a run
    whose target is its start, keep p0 (the caller reads no other), which spares their draws.
    """
    if draws is not None:
        # The largest step first: a run leaves the loop at its first defended step.
        chosen = np.zeros(means.shape[0])
        open_runs = np.flatnonzero(np.any(target != start, axis=-1) & (True if runs is None else runs))
        for a in _CONSERVATIVE_STEPS[:0:-1]:
            if not open_runs.size:
                break
            mixture = start[open_runs] + a * (target[open_runs] - start[open_runs])
            better = _probability_better(objective, means[open_runs], errors[open_runs], mixture, start[open_runs],
                                         draws.of_runs(open_runs), student)
            chosen[open_runs[better > level]] = a
            open_runs = open_runs[better <= level]
        return start + chosen[:, None] * (target - start)
    # The posterior's and the starting mixture's parts are the same at every step: computed once.
    weights = objective.threshold_weights(means.shape[-1])  # (G, K)
    variance = errors[..., objective.guardrail_rows, :] ** 2  # (R, G, K)
    squared_errors = errors**2
    x0 = np.einsum("rmk,rk->rm", means, start)
    value0 = _expected_soft_value(objective, x0, _slack_variance(start, weights, variance), thresholds)
    reference = _reference_side(objective, means, thresholds, start, x0)
    chosen = np.zeros(means.shape[0])
    for a in _CONSERVATIVE_STEPS[1:]:
        mixture = start + a * (target - start)
        x = np.einsum("rmk,rk->rm", means, mixture)
        value = _expected_soft_value(objective, x, _slack_variance(mixture, weights, variance), thresholds)
        error = _difference_error_against(objective, means, squared_errors, thresholds, weights, mixture, reference, x)
        chosen = np.where(value - value0 > np.asarray(z) * error, a, chosen)
    return start + chosen[:, None] * (target - start)


def _defensible(objective, means, errors, thresholds, mixture, constraints, level, draws=None):
    """The best single arm, and whether the plug-in mixture confidently beats it.

    Returns (single (R, K) one-hot, arm_values (R, K), by_delta (R,) bool, by_probability (R,) bool
    or None): the per-arm posterior expected objective (-inf for arms that fail a hard constraint
    on their lower bounds), and the two answers of the one question (both True for a run where no
    single arm is allowed).

    The best single arm is the one a best-arm bandit settles on: the highest posterior expected
    objective E f(mu e_k) among the arms that meet the hard constraints on their lower bounds (its
    posterior mean is already shrunk towards the other arms', so an arm with little data does not
    win on luck). The mixture must beat it with posterior probability above ``level``. By the
    delta method (``by_delta``): its posterior expected objective beats the arm's by
    ndtri(``level``) standard errors of the difference, that probability in closed form when the
    objective is linear in the means. With soft guardrails ``draws`` estimates the probability
    itself (``by_probability``; :func:`_probability_better`): the delta method misses a threshold's
    uncertainty where the penalty's derivative is 0. :func:`choose` serves on the first answer and
    deploys on the second.
    """
    runs, n_metrics, n_arms = means.shape
    per_arm_x = np.swapaxes(means, -1, -2)  # (R, K, M)
    # Var of each arm's guardrail slacks: its own entry, and a relative threshold's reference arm.
    weights = objective.threshold_weights(n_arms)  # (G, K)
    guarded = errors[:, objective.guardrail_rows, :] ** 2  # (R, G, K)
    reference = np.sum(weights**2 * guarded, axis=-1, keepdims=True)  # (R, G, 1)
    per_arm_variance = np.swapaxes(guarded * ((1.0 - weights) ** 2 - weights**2) + reference, -1, -2)  # (R, K, G)
    arm_values = _expected_soft_value(objective, per_arm_x, per_arm_variance, thresholds[:, None, :])
    allowed = np.ones((runs, n_arms), dtype=bool)
    for run, rows in enumerate(constraints):
        if rows.count:
            # A single arm meets row h when A[h, k] >= c[h].
            allowed[run] = np.all(rows.matrix.T >= rows.bounds[None, :] - 1e-12 * rows.scale[None, :], axis=1)
    best = np.argmax(np.where(allowed, arm_values, -np.inf), axis=-1)
    none_allowed = ~allowed.any(axis=-1)
    single = _one_hot(best, n_arms)

    x = np.einsum("rmk,rk->rm", means, mixture)
    mixture_value = _expected_soft_value(objective, x, _guardrail_variance(objective, errors, mixture), thresholds)
    best_value = arm_values[np.arange(runs), best]
    difference_error = _difference_error(objective, means, errors, thresholds, mixture, single)
    by_delta = (mixture_value - best_value > ndtri(level) * difference_error) | none_allowed
    by_probability = None
    if draws is not None:
        by_probability = (_probability_better(objective, means, errors, mixture, single, draws) > level) | none_allowed
    return single, np.where(allowed, arm_values, -np.inf), by_delta, by_probability


def _posterior_noise(rng: np.random.Generator, draws: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal draws (D, M, K) shared by every run of a batch, so each run draws what it would
    draw alone; with no draws one zero draw (the estimated means themselves)."""
    return rng.standard_normal((draws,) + tuple(shape)) if draws else np.zeros((1,) + tuple(shape))


def _kept_margins(objective, means, errors, target, most):
    """How many standard errors of margin the posterior draws keep on each soft guardrail; (R, J).

    ``target`` (R, K) is the expected optimum (:func:`pasto.optimum.expected_optimum`), which
    hedges each soft guardrail as far as its penalty makes a shortfall cost: its multiplier, the
    primary value of relaxing the guardrail, is 2 lambda_j E max(0, -S_j), S_j the slack. So the
    expected shortfall it accepts is the one the optimum of the means accepts, multiplier / 2
    lambda_j. A guardrail whose expected shortfall there is within ``HOLD_TOLERANCE`` of its
    threshold is one the optimum keeps (a steep penalty, or slack): the draws hold it on its
    pessimistic bound, ``most`` standard errors. One the optimum trades against the primary
    metric (a mild penalty) is held only at the margin the expected optimum keeps (0 where it
    misses it): holding it on its pessimistic bound paid for its uncertainty twice (setup A's
    served mixture sat z se / 4 below the optimum's share of the first arm, a regret of z se / 2
    in every round).
    """
    soft = objective.soft_indices[objective.penalties[objective.soft_indices] > 0]
    rows = objective.guardrail_rows[soft]
    thresholds = objective.thresholds(means)[:, soft]  # (R, J)
    slack = np.einsum("rjk,rk->rj", means[:, rows, :], target) - thresholds
    sd = np.sqrt(_guardrail_variance(objective, errors, target)[:, soft])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(sd > 0, slack / sd, np.copysign(np.inf, slack))
        # E max(0, -S) for S ~ N(slack, sd^2): -1/2 of optimum.expected_objective's d-derivative.
        expected_shortfall = np.where(sd > 0, sd * np.exp(-0.5 * ratio**2) / math.sqrt(2.0 * math.pi)
                                      - slack * ndtr(-ratio), np.maximum(-slack, 0.0))
        traded = expected_shortfall > HOLD_TOLERANCE * np.abs(thresholds)
        # The bound's spread per standard error, as _safe_posterior_mixture moves it: the arms'
        # lower bounds against the reference's upper one.
        spread = (np.einsum("rjk,rk->rj", errors[:, rows, :], target)
                  + objective.thresholds(means + errors)[:, soft] - thresholds)
        # The draws' penalty trades the guardrail again from wherever its bound sits (by the
        # expected shortfall, the one the optimum of the means accepts): the bound moves by the
        # rest of the expected optimum's hedge.
        hedge = np.where(spread > 0, (slack + expected_shortfall) / spread, most)
    return np.where(traded, np.clip(hedge, 0.0, most), float(most))


def _safe_posterior_mixture(objective, means, errors, z, target, rng, draws, warm_starts=None):
    """Thompson sampling over safe mixtures: the average of the exact optima of posterior draws.

    Returns the mixtures (R, K) and each run's last solution (R,), a warm start for a nearby problem
    (``warm_starts``: each run's first solve tries that active set first, as every later draw of the
    run tries the one before it).

    means, errors (R, M, K) are the posterior; ``target`` (R, K) is the plug-in optimum. Each of
    ``draws`` draws of the means is solved exactly
    (:func:`pasto.optimum.solve`), with every soft guardrail that the target keeps on the estimated
    means held on its pessimistic bounds: each arm's lower bound (``z`` standard errors, a scalar
    or one per run and soft guardrail (R, J): :func:`_kept_margins`) against a threshold resolved
    on the upper bounds (a relative threshold's reference arm). So the served traffic explores the
    primary metrics as Thompson sampling does, over mixtures instead of single arms, and keeps the
    guardrails the optimum keeps whatever the draw. An arm is served with its posterior chance of
    belonging to the optimal mixture times its share there: exploration that shrinks as the
    posterior concentrates. The objective is concave in the mixture, so serving the average of the
    draws' optima is worth at least their average value (Jensen). With ``draws`` = 0 the estimated
    means are solved the same way: the best known safe mixture.
    """
    soft = objective.soft_indices[objective.penalties[objective.soft_indices] > 0]
    rows = objective.guardrail_rows[soft]
    plain_thresholds = objective.thresholds(means)
    # Kept: met on the means, up to the solver's precision relative to the metric's own scale (a
    # guardrail the optimum keeps binds at its threshold, so rounding must not decide it).
    tolerance = 1e-9 * np.abs(means[:, rows, :]).max(axis=-1, initial=0.0)
    held = np.einsum("rjk,rk->rj", means[:, rows, :], target) >= plain_thresholds[:, soft] - tolerance  # (R, J)
    z = np.broadcast_to(np.asarray(z, dtype=float), held.shape)  # (R, J)
    lower = means[:, rows, :] - z[..., None] * errors[:, rows, :]  # (R, J, K)
    # The thresholds are linear in the means (a relative one in its reference's).
    cautious_thresholds = plain_thresholds.copy()
    cautious_thresholds[:, soft] += z * (objective.thresholds(means + errors) - plain_thresholds)[:, soft]
    # Every run of a batch draws what it would draw alone (the same standard normal draws, as
    # best_arm_probabilities does), so the simulator's batches serve what the service serves.
    noise = _posterior_noise(rng, draws, means.shape[-2:])
    served = np.zeros((means.shape[0], means.shape[-1]))
    solutions = []
    for run in range(means.shape[0]):
        kept = soft[held[run]]
        # A run's draws are nearby problems: each starts from the previous draw's active set (the
        # same optimum, found without HiGHS where the active set has not changed).
        solution = None if warm_starts is None else warm_starts[run]
        for drawn_noise in noise:
            drawn = means[run] + errors[run] * drawn_noise
            thresholds = objective.thresholds(drawn)
            drawn[rows[held[run]]] = lower[run][held[run]]
            thresholds[kept] = cautious_thresholds[run, kept]
            solution = solve(objective, drawn, thresholds, warm_start=solution)
            served[run] += solution.probabilities / noise.shape[0]
        solutions.append(solution)
    return served, solutions


def _observe_start(objective, means, errors, thresholds, counts, served, target, start, z,
                   observations_per_round, t):
    """``served`` (R, K) with shares moved to the starting mixture's arms, as much as the deployed path needs.

    The deployed mixture leaves the starting mixture p0 (R, K) towards ``target`` only as far as the
    evidence defends (:func:`_conservative`): the advantage a = E f(mu target) - E f(mu p0) must
    exceed ``z`` standard errors of the difference, and that difference's variance includes p0's
    arms' estimates. The served traffic follows the posterior draws, which may leave some of p0's
    arms (the production setting; an arm of the uniform start that no optimum uses) nearly
    unobserved, and then the deployed mixture could never leave p0. Each such arm k (served less
    than p0 gives it) carries a part P_k of the variance that shrinks like 1 / n_k in its count;
    the rest V0 does not move. Observing it instead of the served mixture costs
    D_k = f(mu served) - f(mu e_k) per observation. The cheapest counts m_k >= n_k that bring the
    variance to (a / z)^2 if the estimates hold minimise sum_k D_k m_k subject to
    V0 + sum_k P_k n_k / m_k <= (a / z)^2: m_k = max(n_k, sqrt(lambda P_k n_k / D_k)) (the
    Lagrange condition), lambda found on the active set. With as many rounds to come as have been
    (t) the step is worth t a per observation per round, so while t a >= sum_k (m_k - n_k) D_k / Q
    (Q the observations per round) each deficit is spread over that horizon: arm k's share of a
    round is (m_k - n_k) / (Q t) beyond what it is served already, all of them scaled down by one
    factor if needed so that no guardrail the served mixture keeps on the estimates is broken. A
    run whose step is defended, cannot be defended by observing those arms alone (V0 >=
    (a / z)^2), or has no advantage is returned unchanged.
    """
    x, x_start = (np.einsum("rmk,rk->rm", means, mixture) for mixture in (target, start))
    value = _expected_soft_value(objective, x, _guardrail_variance(objective, errors, target), thresholds)
    value_start = _expected_soft_value(objective, x_start, _guardrail_variance(objective, errors, start), thresholds)
    advantage = value - value_start
    parts = _difference_variance_parts(objective, means, errors, thresholds, target, start)  # (R, K)
    total = parts.sum(axis=-1)
    goal = (np.maximum(advantage, 0.0) / np.asarray(z)) ** 2
    under = (start > 0) & (served < start) & (parts > 0)  # (R, K)
    n = np.maximum(counts.min(axis=-2), 1.0)  # (R, K); an arm never observed counts as one
    weight = np.where(under, parts * n, 0.0)  # P_k n_k
    budget = goal - (total - np.where(under, parts, 0.0).sum(axis=-1))  # (a / z)^2 - V0
    possible = (advantage > 0) & (total > goal) & (budget > 0)
    served_value = objective.value(np.einsum("rmk,rk->rm", means, served), thresholds)
    arm_values = objective.value(np.swapaxes(means, -1, -2), thresholds[:, None, :])  # (R, K)
    # Observing an arm no worse than the served mixture costs (almost) nothing.
    price = np.maximum(served_value[:, None] - arm_values, 0.0) + 1e-12 * (np.abs(served_value[:, None]) + 1e-300)
    active = under & possible[:, None]
    wanted = n
    for _ in range(64):  # each pass drops the arms whose best count is what they have (rarely more than 2)
        idle = np.where(under & ~active, weight / n, 0.0).sum(axis=-1)
        left = budget - idle
        # No count of the active arms reaches the goal when the others alone leave no room.
        active &= (left > 0)[:, None]
        root = np.divide(np.where(active, np.sqrt(weight * price), 0.0).sum(axis=-1), left,
                         out=np.zeros_like(left), where=left > 0)  # sqrt(lambda)
        wanted = np.where(active, np.sqrt(np.where(active, weight / price, 0.0)) * root[:, None], n)
        still = active & (wanted > n)
        if np.array_equal(still, active):
            break
        active = still
    deficit = np.where(active, wanted - n, 0.0)
    cost = np.sum(deficit * price, axis=-1)
    per_round = max(observations_per_round, 1.0)
    worth = possible & (t * advantage >= cost / per_round)
    share = np.where(worth[:, None], np.clip(deficit / (per_round * t), 0.0, 1.0), 0.0)
    share = np.maximum(share - served, 0.0)
    total_share = share.sum(axis=-1, keepdims=True)
    share = np.where(total_share > 1.0, share / np.maximum(total_share, 1.0), share)
    return _moved_to(objective, means, thresholds, served, share)


def _difference_variance_parts(objective, means, errors, thresholds, first, second):
    """Each arm's part of :func:`_difference_error`'s variance, (R, K): its entries' terms summed
    over the metrics (the difference's variance is their sum over the arms)."""
    weights = objective.threshold_weights(means.shape[-1])  # (G, K)
    second_part, by_threshold_second = _reference_side(objective, means, thresholds, second)
    gradient_first, by_threshold_first = _sensitivities(objective, means, thresholds, first)
    coefficient = gradient_first[:, :, None] * first[:, None, :] - second_part
    if np.any(weights):
        through_threshold = (by_threshold_first - by_threshold_second)[:, :, None] * weights  # (R, G, K)
        np.add.at(coefficient, (slice(None), objective.guardrail_rows), through_threshold)
    return np.sum(coefficient**2 * errors**2, axis=-2)


def _moved_to(objective, means, thresholds, served, shares):
    """``served`` (R, K) with ``shares`` (R, K) of each run's traffic moved to the arms they name,
    all scaled down by one factor where needed so that no guardrail the served mixture keeps on the
    estimates is broken by the move; O(R M K)."""
    total = shares.sum(axis=-1, keepdims=True)  # (R, 1)
    y = np.einsum("rmk,rk->rm", means, served)[:, objective.guardrail_rows]  # (R, G)
    change = np.einsum("rmk,rk->rm", means, shares)[:, objective.guardrail_rows] - total * y  # at full move
    breaking = (y >= thresholds) & (y + change < thresholds)
    room = np.divide(y - thresholds, -change, out=np.ones_like(y), where=breaking)
    factor = np.clip(room.min(axis=-1, initial=1.0), 0.0, 1.0)[:, None]
    return (1.0 - factor * total) * served + factor * shares
