"""Safe serving: what is served keeps the hard guardrails, exploration is optimistic and shrinks.

The paper's Algorithm 1 guarantees the *average* of the served mixtures p_t; users live with every
p_t. This controller chooses each round's p_t from per-arm confidence bounds (issue 14):

1. **Estimate.** Per arm and metric, the sample mean of the observations since the last detected
   change, shrunk by an empirical-Bayes normal prior centred on the pooled mean across arms (the
   prior variance is the spread of the arms' means beyond their noise), so that arms with little or
   no data still get a finite mean and standard error. The noise variance of an arm is its own
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
3. **Serve.** With hard guardrails: the LP max U_primary . p subject to those constraints, U the
   optimistic (upper) bound of the primary metrics with z_t = optimism * sqrt(2 ln t): arms whose
   upper bound could enter the optimal support get traffic, and that traffic shrinks as the bounds
   narrow. No fixed exploration floor. That optimistic mixture is padded, just enough that every
   lower bound holds, with the mixture of largest worst relative slack on the lower bounds (the
   baseline whenever it is trusted). While no mixture keeps the lower bounds (the first rounds; a
   baseline its own data refute, or none), it is served as it is: exploring is the way to find out
   (padding it to the point estimates instead starved the demo's reference arm and broke its
   deployed mixture, docs/benchmarks.md, "Live demo check"). Without hard guardrails (soft
   penalties only, or none): the hedged plug-in optimum of E f(mu p) (mirror ascent), reached from
   the starting mixture p0 (the baseline arm, else uniform) only as far as the evidence defends
   (conservative bandits: p0 + a (optimum - p0) with the largest a in {0, 0.1, ..., 1} whose
   expected objective beats p0's by ``deploy_level`` Student-t standard errors on the pooled
   degrees of freedom), plus a share directed at the *plausible* arms, those
   whose optimistic gradient (g_k + z_t se(g_k), linearised at the plug-in optimum) reaches the
   optimum's level; each gets 1 / (n sqrt(t)) of the traffic (n observations per round), so the
   exploration vanishes as soon as no arm outside the support can still improve the objective.
   While no mixture is defended (step 5), the option ``undecided`` sends the run's own traffic
   elsewhere: by default (``best_arm``) half of its own path (the conservative path and the
   directed share) after a best-arm bandit (each arm in proportion to its posterior probability
   of being the best single arm, :func:`best_arm_probabilities`: Thompson sampling on the arms'
   metric means), so that a run whose noise forbids a defended mixture finds the single arm it
   deploys instead nearly as a best-arm bandit does; or all of its anchored traffic
   to the optimum of one posterior draw of the means (``mixture_draw``: Thompson sampling over
   mixtures, :func:`drawn_mixture`); ``conservative`` keeps the conservative path (the default
   before issue 14's noise rows were re-measured). With ``posterior_draws`` > 0 (the default: 4;
   issue 14's noise rows), every run also serves, as exploration beside its own path (p =
   (1 - m) own + outside, m the outside mass), the
   mass that the optima of ``posterior_draws`` posterior draws of the means put, on average, on
   arms outside its plug-in support (posterior exploration outside the support), ``posterior_scale``
   times over (2 by default) and at most half of the traffic in all: an arm gets
   traffic in proportion to its posterior chance of belonging to the optimal mixture, so a run
   that found a mixture better than every single arm keeps testing the arms of better mixtures,
   and that traffic vanishes as the posterior concentrates.
4. **Fixed shares.** Optional per-arm ``min_share`` and a ``holdout`` share on the baseline arm are
   carved out first: p = fixed + (1 - sum fixed) q, q optimised on the simplex.
5. **Deploy what can be defended.** The plug-in mixture (pessimistic hard constraints, no
   optimism, no fixed shares) is deployed when its posterior expected objective beats the best
   single arm's (the arm a best-arm bandit settles on: the highest posterior expected objective
   among the arms that meet the hard constraints on their lower bounds) by more than ``z_deploy``
   standard errors of the difference (delta method); otherwise that single arm.
6. **Change.** Every ``change_every`` rounds the observations of the latest block are compared with
   the earlier ones since the last reset, per arm and metric (two-sample z test at family-wise level
   ``change_level`` over the K M pairs). A detected change drops every observation so far (the
   block that raised the alarm too: it is the most extreme stretch of the data); the run is served
   uniformly, keeping its deployed mixture, until its bounds are defined again. No discount
   constant: stale evidence is dropped when the data say it is stale.

The controller follows the contract of :mod:`pasto.algorithm` (``initial_state`` / ``update`` with
leading batch dimensions), so :mod:`pasto.simulate` runs it like the presets.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import linprog
from scipy import stats
from scipy.special import ndtr, ndtri

from pasto.estimators import Estimate, Statistics
from pasto.objectives import Objective
from pasto.optimum import mirror_ascent

__all__ = [
    "ServingConfig",
    "ServingState",
    "HardConstraints",
    "constrained_optimum",
    "has_hard_guardrails",
    "arm_posterior",
    "best_arm_probabilities",
    "drawn_mixture",
    "change_detected",
    "check_objective",
    "choose",
    "hard_constraints",
    "initial_state",
    "update",
    "served_lp",
    "starting_probabilities",
]

# Where an undecided run's traffic goes (ServingConfig.undecided).
UNDECIDED_RULES = ("conservative", "best_arm", "mixture_draw", "mixture_draw_half")
# Prior degrees of freedom pooling an arm's own noise variance with the metric's pooled one.
_VARIANCE_PRIOR_DF = 5.0
# A probability below this in a plug-in optimum counts as outside its support.
_SUPPORT = 1e-3
# Shares of a mirror-ascent solution below this fraction of its largest are served as 0.
_NEGLIGIBLE = 1e-9


@dataclass(frozen=True)
class ServingConfig:
    """Settings of safe serving.

    Attributes
    ----------
    level : float
        One-sided confidence level of the hard guardrails' lower bounds, in (0.5, 1) (0.95).
    optimism : float
        Scale of the primary metrics' upper-bound width z_t = optimism * sqrt(2 ln t) (>= 0).
    min_share : float
        Share every arm keeps, in [0, 1 / K) (0: no floor).
    holdout : float
        Fixed share of the baseline arm, in [0, 1) (0: none; needs a baseline arm).
    deploy_level : float
        One-sided confidence with which the deployed mixture must beat the best single arm, and
        with which the served mixture (soft guardrails) must beat the starting mixture.
    change_level : float
        Family-wise false-alarm probability of each change test, in [0, 1) (0 disables detection).
    change_every : int
        Rounds per change-test block.
    mirror_steps : int
        Mirror-ascent steps of the plug-in solve (soft guardrails).
    undecided : {"conservative", "best_arm", "mixture_draw", "mixture_draw_half"}
        Where the traffic of an *undecided* run goes (soft guardrails only: its plug-in
        optimum is a mixture the data cannot yet defend against the best single arm).
        ``best_arm`` (the default): half of the run's own path (the conservative path and the
        directed share) follows each arm's posterior probability of being the best single arm
        (:func:`best_arm_probabilities`), half keeps that path; the posterior exploration outside
        the support keeps its mass. On setup B at sigma 3.0 (1000 runs) the deployed f is below
        Thompson's in 23.1% of runs against 29.2% with ``conservative``, and at sigma 1.0 the
        median r is 0.901 (docs/benchmarks.md, "Noise rows: the best-arm half of the run's own
        path").
        ``conservative``: the conservative path to the plug-in mixture. ``mixture_draw``:
        Thompson sampling over mixtures, all of it goes to the optimum of one posterior draw of
        the arms' means (:func:`drawn_mixture`); ``mixture_draw_half``: half of it that way, half
        the conservative path (experimental; "Noise rows: Thompson sampling over mixtures").
    posterior_draws : int
        Soft guardrails: posterior draws of the means per round (0 to 64; 0 turns it off) whose
        optima's average mass on arms *outside* the plug-in support is served as exploration, in
        every run (posterior exploration outside the support; the support keeps its path). 4 by
        default (0 is the behaviour before it): the draws' average has the exploration of Thompson
        sampling over mixtures on those arms with a quarter of one draw's variance
        (docs/benchmarks.md, "Noise rows: posterior exploration outside the support").
    posterior_scale : float
        Factor on that mass, in (0, 10]: each run serves ``posterior_scale`` times the draws'
        average mass outside its support, at most half of its traffic in all (1: the mass itself,
        uncapped, the behaviour before the option). 2 by default: at sigma 1.0 on setup B it finds
        the optimal support in more runs (r >= 0.9 in 50% and 52% of two sets of 500 runs, against
        44% and 47%) for 15-17% more served regret; at sigma 3.0 it is even (docs/benchmarks.md,
        "Noise rows: the scale of posterior exploration").
    """

    level: float = 0.95
    optimism: float = 1.0
    min_share: float = 0.0
    holdout: float = 0.0
    deploy_level: float = 0.95
    change_level: float = 1e-4
    change_every: int = 25
    mirror_steps: int = 50
    undecided: str = "best_arm"
    posterior_draws: int = 4
    posterior_scale: float = 2.0

    def __post_init__(self) -> None:
        if self.undecided not in UNDECIDED_RULES:
            raise ValueError(
                f"Serving option 'undecided' must be one of {list(UNDECIDED_RULES)}, got {self.undecided!r}."
            )
        for name in ("level", "optimism", "min_share", "holdout", "deploy_level", "change_level", "posterior_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Serving option {name!r} must be a finite number, got {value!r}.")
            object.__setattr__(self, name, float(value))
        for name in ("level", "deploy_level"):
            if not 0.5 < getattr(self, name) < 1.0:
                raise ValueError(f"Serving option {name!r} must be in (0.5, 1), got {getattr(self, name)}.")
        if self.optimism < 0:
            raise ValueError(f"Serving option 'optimism' must be >= 0, got {self.optimism}.")
        if not 0.0 < self.posterior_scale <= 10.0:
            raise ValueError(f"Serving option 'posterior_scale' must be in (0, 10], got {self.posterior_scale}.")
        for name in ("min_share", "holdout", "change_level"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"Serving option {name!r} must be in [0, 1), got {getattr(self, name)}.")
        for name in ("change_every", "mirror_steps"):
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
class ServingState:
    """Learned state of safe serving.

    Attributes
    ----------
    round_index : int
        Rounds closed so far (shared by the batch).
    probabilities : ndarray, shape (..., K)
        p served in the current round.
    deployed : ndarray, shape (..., K)
        The mixture recommended now.
    log_weights : ndarray, shape (..., K)
        Log of the latest plug-in optimum (warm start of the next solve).
    statistics : Statistics, shape (..., M, K)
        Observations since the last detected change (the estimate's data).
    block : Statistics, shape (..., M, K)
        Observations of the current change-test block.
    resets : ndarray of int, shape (...)
        Changes detected so far.
    """

    round_index: int
    probabilities: np.ndarray
    deployed: np.ndarray
    log_weights: np.ndarray
    statistics: Statistics
    block: Statistics
    resets: np.ndarray


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


def check_objective(objective: Objective) -> None:
    """Raise ValueError for an objective safe serving cannot serve yet: hard and soft guardrails mixed.

    The exact optimum of such an objective is solved (:func:`pasto.optimum.solve`); serving it
    safely is not, so a controller is refused it before its first round rather than at a round close.
    """
    kinds = {_is_hard(g) for g in objective.guardrails}
    if kinds == {True, False}:
        raise ValueError(
            "Safe serving supports hard guardrails, or soft guardrails, but not both in one "
            "objective yet; make every guardrail hard or every guardrail soft (or give the "
            "algorithm serving 'exploration')."
        )


def has_hard_guardrails(objective: Objective) -> bool:
    """Whether some guardrail of ``objective`` is a hard constraint."""
    return any(_is_hard(g) for g in objective.guardrails)


def constrained_optimum(objective: Objective, means: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact optimum under known means (M, K) with hard guardrails only (an LP).

    Returns
    -------
    probabilities : ndarray, shape (K,)
    value : ndarray, shape ()
        Primary value of the optimum (nan when no mixture meets the hard guardrails).
    best_single : ndarray, shape ()
        Primary value of the best single arm that meets them (nan when none does).
    """
    if any(not _is_hard(g) for g in objective.guardrails):
        raise ValueError("constrained_optimum handles hard guardrails only; mixed objectives need pasto.optimum.")
    rows = hard_constraints(objective, means, means, trust_baseline=False)
    gains = objective.primary_weights @ means
    probabilities, feasible = served_lp(gains, rows, np.zeros(means.shape[-1]))
    value = float(gains @ probabilities) if feasible else math.nan
    allowed = np.all(rows.matrix.T >= rows.bounds[None, :] - 1e-12 * rows.scale[None, :], axis=1)
    single = float(np.max(gains[allowed])) if allowed.any() else math.nan
    return probabilities, np.array(value), np.array(single)


def _is_hard(guardrail) -> bool:
    return bool(getattr(guardrail, "hard", False))


def _baseline_index(objective: Objective) -> int | None:
    index = getattr(objective, "baseline_index", None)
    return None if index is None else int(index)


def _arm_index(objective: Objective, name: str) -> int:
    return list(objective.arm_names).index(name)


# --------------------------------------------------------------------------- estimate


def arm_posterior(statistics: Statistics) -> Estimate:
    """Empirical-Bayes per-arm means and standard errors; shapes (..., M, K).

    Each metric's arm means get the normal prior N(m, tau^2): m the mean of the observed arms'
    sample means, tau^2 their variance beyond the average squared standard error (at least 1% of
    their variance). Arm k's noise variance pools its sample variance (n_k - 1 degrees of freedom)
    with the metric's within-arm variance (``_VARIANCE_PRIOR_DF``). Posterior precision
    1 / tau^2 + n_k / s_k^2. Entries are infinite (standard error) while fewer than two arms of a
    metric have data or no arm has two observations.
    """
    n = statistics.counts
    has = n > 0
    mean = np.divide(statistics.sums, n, out=np.zeros_like(statistics.sums), where=has)
    centred = np.maximum(statistics.sums_of_squares - n * mean**2, 0.0)
    df = np.maximum(n - 1.0, 0.0)
    pooled_df = df.sum(axis=-1, keepdims=True)
    pooled_var = np.divide(
        centred.sum(axis=-1, keepdims=True), pooled_df, out=np.full_like(pooled_df, np.inf), where=pooled_df > 0
    )
    with np.errstate(invalid="ignore"):
        noise_var = np.where(
            np.isfinite(pooled_var),
            (centred + _VARIANCE_PRIOR_DF * np.where(np.isfinite(pooled_var), pooled_var, 0.0))
            / (df + _VARIANCE_PRIOR_DF),
            np.inf,
        )
    noise_var = np.maximum(noise_var, 1e-300)
    observed_arms = has.sum(axis=-1, keepdims=True)
    prior_mean = np.divide(
        np.where(has, mean, 0.0).sum(axis=-1, keepdims=True), observed_arms,
        out=np.zeros_like(pooled_df), where=observed_arms > 0,
    )
    spread = np.divide(
        np.where(has, (mean - prior_mean) ** 2, 0.0).sum(axis=-1, keepdims=True), observed_arms - 1.0,
        out=np.full_like(pooled_df, np.inf), where=observed_arms > 1,
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        sampling = np.divide(noise_var, n, out=np.zeros_like(noise_var), where=has)
        average_sampling = np.where(has, sampling, 0.0).sum(axis=-1, keepdims=True) / np.maximum(observed_arms, 1)
        prior_var = np.maximum(spread - average_sampling, 0.01 * spread)
        prior_var = np.where(np.isfinite(prior_var) & (prior_var > 0), prior_var, np.where(spread == 0, 1e-300, np.inf))
        precision = 1.0 / prior_var + np.where(np.isfinite(noise_var), n / noise_var, 0.0)
        posterior_mean = np.where(
            np.isfinite(prior_var),
            (prior_mean / prior_var + np.where(np.isfinite(noise_var), n * mean / noise_var, 0.0)) / precision,
            np.where(has, mean, prior_mean),
        )
        error = np.where(precision > 0, 1.0 / np.sqrt(precision), np.inf)
    error = np.where(np.isfinite(noise_var) | np.isfinite(prior_var), error, np.inf)
    return Estimate(means=posterior_mean, standard_errors=error)


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
    if constraints.count:
        result = linprog(
            -gains, A_ub=-matrix, b_ub=-bounds, A_eq=equality, b_eq=[1.0], bounds=(0, None), method="highs"
        )
    else:
        result = None
    if result is None or result.status == 0:
        if result is None:
            q = np.zeros(n_arms)
            q[np.argmax(gains)] = 1.0
        else:
            q = np.clip(result.x, 0.0, None)
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
    result = linprog(
        objective, A_ub=a_ub, b_ub=-scaled_bounds, A_eq=np.hstack([equality, [[0.0]]]), b_eq=[1.0],
        bounds=[(0, None)] * n_arms + [(None, None)], method="highs",
    )
    q = np.clip(result.x[:n_arms], 0.0, None)
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


def initial_state(
    config: ServingConfig,
    n_arms: int,
    n_metrics: int,
    batch_shape: tuple[int, ...] = (),
    objective: Objective | None = None,
) -> ServingState:
    """Before any data: uniform traffic (no arm is known better), uniform deployed mixture."""
    batch_shape = tuple(int(b) for b in batch_shape)
    probabilities = np.broadcast_to(starting_probabilities(config, objective, n_arms), batch_shape + (n_arms,)).copy()
    return ServingState(
        round_index=0,
        probabilities=probabilities,
        deployed=np.full(batch_shape + (n_arms,), 1.0 / n_arms),
        log_weights=np.full(batch_shape + (n_arms,), -math.log(n_arms)),
        statistics=Statistics.zeros(n_metrics, n_arms, batch_shape),
        block=Statistics.zeros(n_metrics, n_arms, batch_shape),
        resets=np.zeros(batch_shape, dtype=int),
    )


def _soft_value(objective: Objective, x: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """f(x) without the hard guardrails (they are constraints, not penalties); x (..., M)."""
    soft = np.array([not _is_hard(g) for g in objective.guardrails], dtype=bool)
    value = x @ objective.primary_weights
    if soft.any():
        rows = objective.guardrail_rows[soft]
        shortfall = np.minimum(0.0, x[..., rows] - thresholds[..., soft])
        value = value - np.sum(objective.penalties[soft] * shortfall**2, axis=-1)
    return value


def _soft_gradient(objective: Objective, x: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    soft = np.array([not _is_hard(g) for g in objective.guardrails], dtype=bool)
    gradient = np.broadcast_to(objective.primary_weights, x.shape).copy()
    for j in np.flatnonzero(soft):
        row = objective.guardrail_rows[j]
        shortfall = np.minimum(0.0, x[..., row] - thresholds[..., j])
        gradient[..., row] += -2.0 * objective.penalties[j] * shortfall
    return gradient


def change_detected(statistics: Statistics, block: Statistics, level: float) -> np.ndarray:
    """Per run: does some arm and metric's latest block differ from its earlier data? Shape (...).

    Parameters
    ----------
    statistics : Statistics, shape (..., M, K)
        The evidence since the last detected change, the latest block included.
    block : Statistics, shape (..., M, K)
        The latest block's observations.
    level : float
        Family-wise false-alarm probability over the M K two-sample z tests, in (0, 1).
    """
    n_block = block.counts
    n_rest = statistics.counts - n_block
    usable = (n_block >= 2) & (n_rest >= 2)
    mean_block = np.divide(block.sums, n_block, out=np.zeros_like(block.sums), where=n_block > 0)
    rest_sums = statistics.sums - block.sums
    mean_rest = np.divide(rest_sums, n_rest, out=np.zeros_like(rest_sums), where=n_rest > 0)
    total = np.maximum(statistics.counts, 1.0)
    overall = statistics.sums / total
    centred = np.maximum(statistics.sums_of_squares - statistics.counts * overall**2, 0.0)
    # Within-arm variance of the whole span, pooled over arms (a changed mean inflates it, which
    # only makes the test more conservative).
    df = np.maximum(statistics.counts - 1.0, 0.0)
    variance = np.divide(
        centred.sum(axis=-1, keepdims=True), df.sum(axis=-1, keepdims=True),
        out=np.full(centred.shape[:-1] + (1,), np.inf), where=df.sum(axis=-1, keepdims=True) > 0,
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.abs(mean_block - mean_rest) / np.sqrt(
            variance * (1.0 / np.maximum(n_block, 1.0) + 1.0 / np.maximum(n_rest, 1.0))
        )
    z = np.where(usable & np.isfinite(z), z, 0.0)
    tests = max(1, int(np.prod(statistics.shape[-2:])))
    critical = float(ndtri(1.0 - level / (2.0 * tests)))
    return np.max(z, axis=(-2, -1)) > critical


def update(
    config: ServingConfig,
    objective: Objective,
    state: ServingState,
    round_statistics: Statistics,
    pooled_statistics: Statistics | None = None,
    propensities: np.ndarray | None = None,
) -> ServingState:
    """Close a round: take in its observations and choose the next round's served and deployed mixtures.

    Parameters
    ----------
    config : ServingConfig
    objective : Objective
    state : ServingState
    round_statistics : Statistics, shape (..., M, K)
        Observations that arrived in the closing round.
    pooled_statistics, propensities
        Unused (the estimate is kept in the state, since the last detected change); accepted for
        the controller contract of :mod:`pasto.algorithm`.

    Returns
    -------
    ServingState
    """
    del pooled_statistics, propensities
    if round_statistics.shape != state.statistics.shape:
        raise ValueError(
            f"round_statistics must have shape {state.statistics.shape} (batch, metrics, arms), "
            f"got {round_statistics.shape}."
        )
    with np.errstate(over="ignore", invalid="ignore"):
        return _advance(config, objective, state, round_statistics)


def _advance(config, objective, state, round_statistics):
    t = state.round_index + 1
    n_arms = state.probabilities.shape[-1]
    batch = state.probabilities.shape[:-1]
    statistics = state.statistics + round_statistics
    block = state.block + round_statistics
    resets = state.resets
    if config.change_level > 0 and t % config.change_every == 0:
        changed = change_detected(statistics, block, config.change_level)
        if changed.any():
            # Start afresh: the block that raised the alarm is the most extreme stretch of the
            # data, so keeping it would bias the new estimate (a false alarm on setup A kept a
            # block where the guardrail-breaking arm looked harmless, and deployed it alone).
            drop = changed[..., None, None]
            statistics = Statistics(
                np.where(drop, 0.0, statistics.counts),
                np.where(drop, 0.0, statistics.sums),
                np.where(drop, 0.0, statistics.sums_of_squares),
            )
            resets = resets + changed
        block = Statistics.zeros(*statistics.shape[-2:], batch)

    observations = float(round_statistics.counts[..., 0, :].sum()) / max(1, int(np.prod(batch)))
    served, deployed, log_weights = choose(
        config, objective, statistics, t, state.log_weights, observations, state.deployed
    )
    return ServingState(
        round_index=t,
        probabilities=served,
        deployed=deployed,
        log_weights=log_weights,
        statistics=statistics,
        block=block,
        resets=resets,
    )


def choose(
    config: ServingConfig,
    objective: Objective,
    statistics: Statistics,
    round_number: int,
    log_weights: np.ndarray,
    observations_per_round: float,
    deployed: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The served and deployed mixtures for the next round, from the observations ``statistics``.

    Parameters
    ----------
    config : ServingConfig
    objective : Objective
    statistics : Statistics, shape (..., M, K)
        The evidence (since the last detected change, or all of it).
    round_number : int
        t, the round just closed (1-based): the optimism width grows like sqrt(2 ln t).
    log_weights : ndarray, shape (..., K)
        Warm start of the plug-in solve (the previous plug-in optimum's log).
    observations_per_round : float
        Observations per run and round (n), which sets the directed exploration share 1 / (n sqrt(t)).
    deployed : ndarray, shape (..., K)
        The mixture deployed now, kept by runs whose bounds are not defined yet.

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
    z_optimism = config.optimism * math.sqrt(2.0 * math.log(max(t, 2)))
    z_deploy = float(ndtri(config.deploy_level))
    lower, upper = means - z_guard * errors, means + z_guard * errors
    constraints = hard_constraints(objective, lower, upper)
    thresholds = objective.thresholds(means)
    weights = objective.primary_weights
    # Optimistic primary value of each arm: upper bound for positive weights, lower for negative.
    primary_errors = np.sqrt(np.einsum("m,...mk->...k", weights**2, errors**2))
    plain_gains = np.einsum("m,...mk->...k", weights, means)
    optimistic_gains = plain_gains + z_optimism * primary_errors

    flat = int(np.prod(batch)) if batch else 1
    flat_means = means.reshape((flat,) + means.shape[-2:])
    flat_errors = errors.reshape(flat_means.shape)
    flat_thresholds = thresholds.reshape((flat,) + thresholds.shape[-1:])
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
    if constraints.count:
        check_objective(objective)
        optimistic = optimistic_gains.reshape((flat, n_arms))
        plain = plain_gains.reshape((flat, n_arms))
        # Every arm at its upper bound (the reference arm of a relative guardrail too).
        hopeful = hard_constraints(objective, means + z_optimism * errors, means + z_optimism * errors)
        hopeful_rows = _unbatched(hopeful, flat)
        for run in range(flat):
            # Optimistic in the objective and in the guardrails (every arm at its upper bound):
            # the arms that could improve the objective or make room for others get traffic ...
            hopeful_mixture, _ = served_lp(optimistic[run], hopeful_rows[run], fixed)
            # ... mixed with the mixture with the most pessimistic slack just enough that every
            # hard guardrail's lower bound holds (stochastic bandits with linear constraints).
            # When the hopeful mixture already meets every lower bound, _pad returns it unchanged:
            # the largest-slack LP (a quarter of a segmented run's time) is then skipped.
            if _meets(hopeful_mixture, rows[run]):
                served[run] = hopeful_mixture
            else:
                served[run] = _pad(hopeful_mixture, largest_slack(rows[run], fixed), rows[run])
            plug_in[run], _ = served_lp(plain[run], deploy_rows[run], np.zeros(n_arms))
        log_weights = np.log(np.maximum(plug_in, 1e-300))
    else:
        lifted = np.maximum(log_weights, log_weights.max(axis=-1, keepdims=True) - 30.0)
        # The expected objective E f(mu p), mu ~ N(V, se^2), hedges against the steep side of a
        # soft penalty (serving too much of an arm whose guardrail estimate is too optimistic).
        log_weights = mirror_ascent(
            objective, flat_means, flat_thresholds, lifted, config.mirror_steps, standard_errors=flat_errors
        )
        plug_in = np.exp(log_weights)
        # Mirror ascent never reaches an exact zero; traffic below this share is noise, not a choice.
        plug_in = np.where(plug_in < _NEGLIGIBLE * plug_in.max(axis=-1, keepdims=True), 0.0, plug_in)
        plug_in /= plug_in.sum(axis=-1, keepdims=True)
        plausible = _plausible_arms(objective, flat_means, flat_errors, flat_thresholds, plug_in, z_optimism)
        plausible &= plug_in < _SUPPORT
        per_round = max(observations_per_round, 1.0)
        share = np.minimum(0.5, plausible.sum(axis=-1) / (per_round * math.sqrt(t)))
        directed = np.divide(plausible, plausible.sum(axis=-1, keepdims=True),
                             out=np.zeros_like(plug_in), where=plausible.any(axis=-1, keepdims=True))
        # The standard errors rest on estimated noise variances: Student's t with the pooled degrees
        # of freedom (few observations per arm would otherwise look more certain than they are).
        degrees = np.maximum(statistics.counts - 1.0, 0.0).sum(axis=-1).min(axis=-1).reshape(flat)
        z_student = stats.t.ppf(config.deploy_level, np.maximum(degrees, 1.0))
        anchored = _conservative(objective, flat_means, flat_errors, flat_thresholds, plug_in, z_student)

    chosen, defended, arm_values = _defensible(
        objective, flat_means, flat_errors, flat_thresholds, plug_in, deploy_rows, z_safe, z_deploy
    )
    if not constraints.count:
        # Undecided: the plug-in optimum is a mixture the data cannot yet defend against the best
        # single arm. (When the plug-in is that arm itself, as with no guardrails, there is no
        # choice to hedge and the traffic follows it.)
        undecided = ~defended & (np.abs(plug_in - chosen).sum(axis=-1) > 1e-6)
        best_arm = None
        if undecided.any() and config.undecided == "best_arm":
            # No mixture is confidently better than the best single arm yet: half of the run's own
            # path (the conservative path to the plug-in mixture and the directed share) goes
            # where a best-arm bandit would send it (each arm in proportion to its posterior
            # probability of being the best single arm, as Thompson sampling does), so that when
            # the noise forbids a defended mixture the arm deployed instead is found as fast as a
            # best-arm bandit finds it; the other half keeps that path (the top-two Thompson split,
            # beta = 1/2). The posterior exploration outside the support (below) keeps its whole
            # mass: it is what finds the support of a better mixture.
            # Measured on setup B (1000 runs, docs/benchmarks.md, "Noise rows: the best-arm half
            # of the run's own path"): at sigma 3.0 the deployed f falls below Thompson's in 23.1%
            # of runs (25.7% when the half was taken of the conservative path only, inside the
            # directed share and the posterior exploration, which left the best-arm bandit a
            # sixth of the traffic while those were wide), and the served regret falls by a
            # quarter; at sigma 1.0 the median r is 0.901 (0.909) for 16% less served regret. Half
            # of *all* the traffic halved the posterior exploration too: sigma 3.0 at 19.6%, but
            # a sigma 1.0 median r of 0.851.
            # The draws are seeded by the round, so a round's choice is reproducible.
            best_arm = best_arm_probabilities(
                objective, flat_means, flat_errors, flat_thresholds, np.random.default_rng([t, 14]),
                allowed=np.isfinite(arm_values),
            )
        elif undecided.any() and config.undecided in ("mixture_draw", "mixture_draw_half"):
            # Thompson sampling over mixtures: the data cannot yet tell the plug-in mixture from
            # the best single arm, so the traffic goes to the optimum of one posterior draw of the
            # means. The arms of the optimal mixture are in that optimum with the posterior
            # probability that they belong there, which aims the exploration at the support the
            # median r needs (issue 14: on main only 61% of the observations at sigma 1.0 land
            # there). Seeded by the round, so a round's choice is reproducible.
            start = np.log(0.5 * plug_in + 0.5 / n_arms)
            draw = drawn_mixture(
                objective, flat_means, flat_errors, start, 2 * config.mirror_steps, np.random.default_rng([t, 15])
            )
            if config.undecided == "mixture_draw_half":
                # The top-two split of best_arm: half the draw's mixture, half the conservative path.
                draw = 0.5 * draw + 0.5 * anchored
            anchored = np.where(undecided[:, None], draw, anchored)
        if config.posterior_draws:
            # Posterior exploration outside the support: every run also serves the mass that the
            # optima of posterior draws of the means put on arms outside its plug-in support (the
            # average of ``posterior_draws`` draws' optima). Without it a run whose mixture beats the
            # best single arm keeps serving that mixture's support, and an arm that belongs to a
            # better mixture is explored only by the small directed share: at sigma 1.0 on setup B
            # (500 runs), 84% of the deployed mixtures with 0 < r < 0.9 held an arm outside the
            # optimal support. The support itself keeps its conservative path, so a run whose
            # support is known (setup A: both arms) pays nothing for it. The mass an arm gets is its
            # posterior probability-weighted share in the optimum, which shrinks as the bounds
            # narrow. Seeded by the round, so a round's choice is reproducible.
            rng = np.random.default_rng([t, 15])
            start = np.log(0.5 * plug_in + 0.5 / n_arms)
            posterior = drawn_mixture(
                objective, flat_means, flat_errors, start, 2 * config.mirror_steps, rng, config.posterior_draws
            ).mean(axis=0)
            outside = np.where(plug_in < _SUPPORT, posterior, 0.0)
            if config.posterior_scale != 1.0:
                # One posterior draw's optimum rarely holds an arm that is only a close second for
                # a place in the support, so the draws' average tests such arms too timidly: at
                # sigma 1.0 on setup B (500 runs), twice the mass found the optimal support in 50%
                # of runs against 44% (three times: 50%, with more runs below the best arm). The
                # cap keeps half of the traffic on the run's own path while the posterior is wide.
                total = outside.sum(axis=-1, keepdims=True)
                scaled = np.minimum(config.posterior_scale * total, 0.5)
                outside = np.divide(outside * scaled, total, out=np.zeros_like(outside), where=total > 0)
        else:
            outside = np.zeros_like(plug_in)
        if config.undecided in ("mixture_draw", "mixture_draw_half"):
            # Those runs' traffic already follows a posterior draw.
            outside = np.where(undecided[:, None], 0.0, outside)
        own = (1.0 - share[:, None]) * anchored + share[:, None] * directed
        if best_arm is not None:
            own = np.where(undecided[:, None], 0.5 * best_arm + 0.5 * own, own)
        served = (1.0 - outside.sum(axis=-1, keepdims=True)) * own + outside
        served = fixed + (1.0 - fixed.sum()) * served
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


def drawn_mixture(
    objective: Objective,
    means: np.ndarray,
    errors: np.ndarray,
    log_weights: np.ndarray,
    steps: int,
    rng: np.random.Generator,
    draws: int | None = None,
) -> np.ndarray:
    """The optimum of f(mu p) for one posterior draw mu ~ N(means, errors^2) per run; (..., K), or
    for ``draws`` independent draws per run; (draws, ..., K).

    Thompson sampling over mixtures: each entry of mu is drawn independently; the mixture maximises
    the objective under the draw (mirror ascent from ``log_weights``, ``steps`` iterations; shares
    below ``_NEGLIGIBLE`` of the largest are 0). Every run of a batch uses the same standard-normal
    draws (scaled by its own errors), so that a batched call equals per-run calls with generators
    in the same state.

    Parameters
    ----------
    objective : Objective
    means : ndarray, shape (..., M, K)
        Posterior means.
    errors : ndarray, shape (..., M, K)
        Posterior standard deviations (>= 0, finite).
    log_weights : ndarray, shape (..., K)
        Warm start of the solve (finite).
    steps : int
        Mirror-ascent iterations.
    rng : numpy.random.Generator
    draws : int, optional
        Solve this many draws in one batched mirror ascent (the same as ``draws`` calls in a row on
        the same generator, for a fraction of the per-call overhead that dominates at small K).

    Returns
    -------
    ndarray, shape (..., K) or (draws, ..., K)
        Mixtures: non-negative, summing to 1 along the last axis.
    """
    means = np.asarray(means, dtype=float)
    errors = np.asarray(errors, dtype=float)
    log_weights = np.asarray(log_weights, dtype=float)
    if draws is None:
        drawn = means + errors * rng.standard_normal(means.shape[-2:])
    else:
        # One (M, K) block per draw, in the order ``draws`` single calls would draw them.
        noise = rng.standard_normal((draws,) + means.shape[-2:])
        drawn = means + errors * noise.reshape((draws,) + (1,) * (means.ndim - 2) + means.shape[-2:])
        log_weights = np.broadcast_to(log_weights, drawn.shape[:-2] + log_weights.shape[-1:])
    log_p = mirror_ascent(objective, drawn, objective.thresholds(drawn), log_weights, steps)
    mixture = np.exp(log_p - log_p.max(axis=-1, keepdims=True))
    mixture = np.where(mixture < _NEGLIGIBLE, 0.0, mixture)
    return mixture / mixture.sum(axis=-1, keepdims=True)


def _meets(mixture: np.ndarray, constraints: HardConstraints) -> bool:
    """Whether ``A p >= c`` holds for the mixture (K,) on every row: :func:`_pad`'s first test."""
    return bool(np.all(constraints.matrix @ mixture - constraints.bounds >= 0))


def _pad(mixture: np.ndarray, safe: np.ndarray, constraints: HardConstraints) -> np.ndarray:
    """(1 - a) mixture + a safe with the smallest a in [0, 1] meeting ``A p >= c``, (K,).

    When even ``safe`` misses a row (nothing is known to be feasible), ``mixture`` is returned:
    there is nothing safer to pad with, and exploring is the way to find out. (Serving ``safe``
    instead kept setup-b-hard's runs on a largest-slack mixture that broke a guardrail, never
    learning the other arms: served hold 0.65 instead of 0.99 after round 20.)
    """
    if _meets(mixture, constraints):
        return mixture
    have = constraints.matrix @ mixture - constraints.bounds
    margin = constraints.matrix @ safe - constraints.bounds
    if np.any(margin < 0):
        return mixture
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


def _plausible_arms(objective, means, errors, thresholds, mixture, z):
    """Arms whose optimistic gradient reaches the mixture's level (could enter the support); (R, K) bool."""
    x = np.einsum("rmk,rk->rm", means, mixture)
    gradient_x = _soft_gradient(objective, x, thresholds)
    gradient = np.einsum("rmk,rm->rk", means, gradient_x)
    level = np.sum(mixture * gradient, axis=-1, keepdims=True)
    spread = np.sqrt(np.einsum("rm,rmk->rk", gradient_x**2, errors**2))
    return gradient + z * spread >= level - 1e-12 * np.abs(level)


def _expected_soft_value(objective: Objective, x: np.ndarray, variance: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """E f(X) without the hard guardrails for X ~ N(x, diag(variance)); x, variance (..., M), thresholds (..., G).

    The primary part is linear; soft guardrail j contributes -lambda_j E min(0, Y_j - c_j)^2 with
    E min(0, Y - c)^2 = (d^2 + s^2) Phi(-d/s) - d s phi(d/s), d = E Y - c, s = sd Y.
    """
    soft = np.array([not _is_hard(g) for g in objective.guardrails], dtype=bool)
    value = x @ objective.primary_weights
    if soft.any():
        rows = objective.guardrail_rows[soft]
        d = x[..., rows] - thresholds[..., soft]
        sd = np.sqrt(np.maximum(variance[..., rows], 0.0))
        uncertain = sd > 1e-300
        ratio = np.where(uncertain, d / np.where(uncertain, sd, 1.0), 0.0)
        tail = (d**2 + sd**2) * ndtr(-ratio) - d * sd * np.exp(-0.5 * ratio**2) / math.sqrt(2.0 * math.pi)
        shortfall = np.where(uncertain, tail, np.minimum(0.0, d) ** 2)
        value = value - np.sum(objective.penalties[soft] * shortfall, axis=-1)
    return value


# Steps from the starting mixture towards the plug-in optimum tried by _conservative.
_CONSERVATIVE_STEPS = np.linspace(0.0, 1.0, 11)


def _conservative(objective, means, errors, thresholds, target, z):
    """Serve ``target`` only as far from the starting mixture as the evidence defends; (R, K).

    Conservative bandits (Wu et al., ICML 2016): the starting mixture p0 (the baseline arm when
    the objective names one, else uniform) is what a team runs before pasto learns anything. The
    served mixture is p0 + a (target - p0) with the largest a in {0, 0.1, ..., 1} whose posterior
    expected objective beats p0's by ``z`` standard errors of the difference (delta method), or
    a = 0. With little data the traffic stays at p0 instead of following a plug-in optimum that the
    noise moves around; a good plug-in optimum is served as soon as it is confidently better, and a
    start as bad as the uniform mixture on setup B is left within a few rounds.
    """
    runs, n_metrics, n_arms = means.shape
    baseline = _baseline_index(objective)
    start = np.full(n_arms, 1.0 / n_arms) if baseline is None else np.eye(n_arms)[baseline]
    start = np.broadcast_to(start, target.shape)
    variance = errors**2
    x0 = np.einsum("rmk,rk->rm", means, start)
    value0 = _expected_soft_value(objective, x0, np.einsum("rmk,rk->rm", variance, start**2), thresholds)
    gradient0 = _soft_gradient(objective, x0, thresholds)
    chosen = np.zeros(runs)
    for a in _CONSERVATIVE_STEPS[1:]:
        mixture = start + a * (target - start)
        x = np.einsum("rmk,rk->rm", means, mixture)
        value = _expected_soft_value(objective, x, np.einsum("rmk,rk->rm", variance, mixture**2), thresholds)
        gradient = _soft_gradient(objective, x, thresholds)
        coefficient = gradient[:, :, None] * mixture[:, None, :] - gradient0[:, :, None] * start[:, None, :]
        error = np.sqrt(np.sum(coefficient**2 * variance, axis=(-2, -1)))
        chosen = np.where(value - value0 > np.asarray(z) * error, a, chosen)
    return start + chosen[:, None] * (target - start)


def _defensible(objective, means, errors, thresholds, mixture, constraints, z_safe, z_deploy):
    """The plug-in mixture when it confidently beats the best single arm, else that arm.

    Returns (deployed (R, K), mixture_defended (R,) bool, arm_values (R, K)): the per-arm
    posterior expected objective (-inf for arms that fail a hard constraint on their lower
    bounds).

    The best single arm is the one a best-arm bandit settles on: the highest posterior expected
    objective E f(mu e_k) among the arms that meet the hard constraints on their lower bounds (its
    posterior mean is already shrunk towards the other arms', so an arm with little data does not
    win on luck). The mixture must beat it in posterior expected objective by ``z_deploy``
    standard errors of the difference (delta method).
    """
    del z_safe
    runs, n_metrics, n_arms = means.shape
    eye = np.eye(n_arms)
    per_arm_x = np.swapaxes(means, -1, -2)  # (R, K, M)
    per_arm_variance = np.swapaxes(errors**2, -1, -2)
    arm_values = _expected_soft_value(objective, per_arm_x, per_arm_variance, thresholds[:, None, :])
    allowed = np.ones((runs, n_arms), dtype=bool)
    for run, rows in enumerate(constraints):
        if rows.count:
            # A single arm meets row h when A[h, k] >= c[h].
            allowed[run] = np.all(rows.matrix.T >= rows.bounds[None, :] - 1e-12 * rows.scale[None, :], axis=1)
    best = np.argmax(np.where(allowed, arm_values, -np.inf), axis=-1)
    none_allowed = ~allowed.any(axis=-1)
    single = eye[best]

    x = np.einsum("rmk,rk->rm", means, mixture)
    mixture_variance = np.einsum("rmk,rk->rm", errors**2, mixture**2)
    mixture_value = _expected_soft_value(objective, x, mixture_variance, thresholds)
    gradient_x = _soft_gradient(objective, x, thresholds)
    best_x = per_arm_x[np.arange(runs), best]
    best_value = arm_values[np.arange(runs), best]
    best_gradient = _soft_gradient(objective, best_x, thresholds)
    # Var of f(V p) - f(V e_b) by the delta method: entry (m, k) enters with coefficient
    # df/dx_m (p) p_k - df/dx_m (e_b) [k == b].
    coefficient = gradient_x[:, :, None] * mixture[:, None, :] - best_gradient[:, :, None] * single[:, None, :]
    difference_error = np.sqrt(np.sum(coefficient**2 * errors**2, axis=(-2, -1)))
    confident = mixture_value - best_value > z_deploy * difference_error
    use_mixture = confident | none_allowed
    return np.where(use_mixture[:, None], mixture, single), use_mixture, np.where(allowed, arm_values, -np.inf)
