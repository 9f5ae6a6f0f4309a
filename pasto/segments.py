"""Per-segment mixtures: statistics with a segment axis, empirical-Bayes shrinkage, the joint LP.

Model
    S segments (new / returning users, countries, surfaces) with traffic shares w_s (sum 1) and their
    own unknown M x K mean matrices mu_s. Segment s serves its own mixture p_s. The platform-wide
    value of metric m is the traffic-weighted sum_s w_s (mu_s p_s)_m. The joint problem is

        max_{p_1..p_S}  sum_s w_s a . (mu_s p_s)                     (a = the primary weights)
        s.t.  g_j . (mu_s p_s) >= c_{s,j}        for every segment s  (guardrail j scoped "segment")
              sum_s w_s g_j . (mu_s p_s) >= c_j                       (guardrail j scoped "global")
              p_s in the simplex.

    With hard guardrails this is ONE linear program over the K x S variables (:func:`solve_joint`,
    HiGHS through :func:`pasto.optimum.linear_program`). Restriction: soft (penalised) guardrails are not part
    of the joint problem; a segmented objective with soft guardrails is rejected with a sentence
    saying so (give them ``"hard": true``). Per-segment thresholds are resolved on the segment's
    means, global ones on the traffic-weighted means sum_s w_s mu_s (this matters for ``relative_to``).

Statistics
    The segmented controller keeps a :class:`pasto.estimators.Statistics` of shape (..., S, M, K):
    the unsegmented statistics with one more batch axis. :func:`pool_segments` sums it over segments.

Shrinkage (empirical Bayes, normal-normal)
    For metric m and arm k, segment means are modelled as mu_s ~ N(m, tau^2) around the pooled
    mean m, and the segment's sample mean as ybar_s ~ N(mu_s, sigma^2 / n_s). The posterior mean is
    (n_s ybar_s + n0 m) / (n_s + n0) with the prior pseudo-count n0 = sigma^2 / tau^2: shrinking
    is adding n0 pseudo-observations at the pooled mean, so the shrunk statistics are again
    :class:`Statistics` that every estimator of :mod:`pasto.estimators` reads unchanged.
    tau^2 is learned by the method of moments from the spread of the segment means,
    tau^2 = max(0, var_s(ybar_s) - mean_s(sigma^2 / n_s)), separately for every metric and arm:
    the decision depends on arm contrasts within a segment, and arms differ in how much they vary
    across segments (a setting tuned for one device class is segment-sensitive, the production
    setting often is not), so one tau^2 per metric would over-shrink the arms that differ and
    under-shrink the ones that do not. With fewer than two segments with data there is nothing to
    learn tau^2 from and nothing is shrunk (so one segment is exactly the unsegmented controller).
    A (metric, arm) cell a segment has no observation of gets the pooled mean (at least one
    pseudo-observation).

Controller
    :func:`segmented_update` runs :func:`pasto.algorithm.update` on the (..., S) batch of segments
    (the estimator, EG step, per-segment solve, exploration schedule, all per segment) with the
    shrunk statistics, then, with more than one segment, every ``solve_every`` rounds solves the
    joint LP on the shrunk estimate (guardrail rows at lower confidence bounds, ``confidence_z``
    standard errors below) and serves each segment (1 - eps_t) p*_s + eps_t / K. A segment with no
    data of its own serves the global mixture (the single-mixture optimum on the pooled estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pasto import algorithm
from pasto.diagnostics import guardrail_report
from pasto.estimators import Estimate, Statistics, pooled_estimate
from pasto.objectives import Objective
from pasto.optimum import linear_program, solve

__all__ = [
    "SCOPES",
    "pool_segments",
    "segment_statistics",
    "Shrinkage",
    "shrinkage",
    "shrink",
    "shrunk_estimate",
    "JointSolution",
    "solve_joint",
    "global_mixture",
    "segmented_values",
    "SegmentedConfig",
    "SegmentedState",
    "initial_segmented_state",
    "segmented_update",
    "joint_exploration",
    "add_segments",
    "check_scopes",
    "aggregate_state",
    "measured_shares",
    "SegmentReport",
    "segment_report",
]

SCOPES = ("segment", "global")
# A pseudo-count this large is "pool completely" (tau^2 = 0) while keeping the arithmetic finite.
_FULL_POOLING = 1e12


# ----------------------------------------------------------------------------- statistics
def pool_segments(statistics: Statistics) -> Statistics:
    """Sum statistics of shape (..., S, M, K) over the segment axis: shape (..., M, K)."""
    return Statistics(
        statistics.counts.sum(axis=-3), statistics.sums.sum(axis=-3), statistics.sums_of_squares.sum(axis=-3)
    )


def segment_statistics(
    segments: np.ndarray, arms: np.ndarray, values: np.ndarray, n_segments: int, n_arms: int
) -> Statistics:
    """Statistics of single observations with a segment axis.

    Parameters
    ----------
    segments, arms : ndarray of int, shape (..., N)
        Segment and arm of each observation.
    values : ndarray, shape (..., N, M)
        Observed metric values (nan = not observed).
    n_segments, n_arms : int

    Returns
    -------
    Statistics
        Shape (..., S, M, K).
    """
    segments = np.asarray(segments, dtype=np.intp)
    arms = np.asarray(arms, dtype=np.intp)
    # One "arm" per (segment, arm) pair, then the pair axis is split back into (S, K).
    flat = Statistics.from_observations(segments * n_arms + arms, values, n_segments * n_arms)
    shape = flat.counts.shape[:-1] + (n_segments, n_arms)

    def split(a: np.ndarray) -> np.ndarray:
        return np.moveaxis(a.reshape(shape), -2, -3)

    return Statistics(split(flat.counts), split(flat.sums), split(flat.sums_of_squares))


# ----------------------------------------------------------------------------- shrinkage
@dataclass(frozen=True)
class Shrinkage:
    """The empirical-Bayes prior learned from the segments.

    Attributes
    ----------
    pooled_means : ndarray, shape (..., M, K)
        m: the pooled (all-segment) sample means.
    within_variance : ndarray, shape (..., M, K)
        sigma^2: the pooled within-segment variance of one observation.
    between_variance : ndarray, shape (..., M, K)
        tau^2: the variance of the true segment means around m (method of moments, >= 0).
    pseudo_counts : ndarray, shape (..., M, K)
        n0 = sigma^2 / tau^2 (0 when nothing is learned, ``1e12`` when tau^2 = 0: full pooling).
    """

    pooled_means: np.ndarray
    within_variance: np.ndarray
    between_variance: np.ndarray
    pseudo_counts: np.ndarray


def shrinkage(statistics: Statistics) -> Shrinkage:
    """Learn the prior (pooled means, sigma^2, tau^2, n0) from statistics of shape (..., S, M, K)."""
    n = statistics.counts
    total = n.sum(axis=-3)
    pooled_sums = statistics.sums.sum(axis=-3)
    pooled_means = np.divide(pooled_sums, total, out=np.zeros_like(pooled_sums), where=total > 0)
    has = n > 0
    segment_means = np.divide(statistics.sums, n, out=np.zeros_like(statistics.sums), where=has)
    # Within-segment sum of squares, pooled over segments (each segment around its own mean).
    within_ss = np.maximum(statistics.sums_of_squares - n * segment_means**2, 0.0).sum(axis=-3)
    with_data = has.sum(axis=-3)
    dof = total - with_data
    within = np.divide(within_ss, dof, out=np.zeros_like(within_ss), where=dof > 0)
    # Method of moments over the segments with data: spread of ybar_s minus the sampling part.
    several = with_data >= 2
    average = np.divide(
        np.where(has, segment_means, 0.0).sum(axis=-3), with_data, out=np.zeros_like(within), where=with_data > 0
    )
    spread = np.where(has, (segment_means - average[..., None, :, :]) ** 2, 0.0).sum(axis=-3)
    observed_variance = np.divide(spread, with_data - 1.0, out=np.zeros_like(spread), where=several)
    sampling = np.divide(within[..., None, :, :], n, out=np.zeros_like(n), where=has)
    mean_sampling = np.divide(sampling.sum(axis=-3), with_data, out=np.zeros_like(within), where=with_data > 0)
    between = np.maximum(observed_variance - mean_sampling, 0.0)
    pseudo = np.where(
        several,
        np.divide(within, between, out=np.full_like(within, _FULL_POOLING), where=between > 0),
        0.0,
    )
    pseudo = np.minimum(pseudo, _FULL_POOLING)
    return Shrinkage(pooled_means, within, between, pseudo)


def shrink(statistics: Statistics, prior: Shrinkage | None = None) -> Statistics:
    """Shrunk statistics (..., S, M, K): each segment's plus n0 pseudo-observations at the pooled mean.

    The pseudo-observations have the pooled mean and the within-segment variance, so
    :func:`pasto.estimators.pooled_estimate` of the result is the posterior mean
    (n ybar + n0 m) / (n + n0) with standard error about sigma / sqrt(n + n0). A cell without
    observations in its segment gets at least one pseudo-observation when the pooled data have one.
    """
    if prior is None:
        prior = shrinkage(statistics)
    n0 = np.broadcast_to(prior.pseudo_counts[..., None, :, :], statistics.counts.shape)
    pooled_has = np.broadcast_to((statistics.counts.sum(axis=-3) > 0)[..., None, :, :], n0.shape)
    n0 = np.where((statistics.counts == 0) & pooled_has, np.maximum(n0, 1.0), n0)
    m = prior.pooled_means[..., None, :, :]
    variance = prior.within_variance[..., None, :, :]
    return Statistics(
        statistics.counts + n0,
        statistics.sums + n0 * m,
        statistics.sums_of_squares + n0 * (m**2 + variance),
    )


def shrunk_estimate(statistics: Statistics, enabled: bool = True) -> Estimate:
    """Per-segment estimate (..., S, M, K): the posterior means and their standard errors.

    The standard error counts both parts of the posterior mean (n ybar + n0 m) / (n + n0): the
    segment's own sampling error, sigma^2 / (n + n0) (the pseudo-observations carry no noise of
    their own), and the pooled mean's, (n0 / (n + n0))^2 sigma^2 / N with N the pooled count, so that a
    fully pooled segment is as uncertain as the pooled mean and not certain. With ``enabled`` False:
    the segments' own sample means (:func:`pasto.estimators.pooled_estimate`, the ablation).
    """
    if not enabled:
        return pooled_estimate(statistics)
    prior = shrinkage(statistics)
    shrunk = shrink(statistics, prior)
    means = pooled_estimate(shrunk).means
    total = shrunk.counts
    own = statistics.counts
    pooled_count = statistics.counts.sum(axis=-3)[..., None, :, :]
    variance = prior.within_variance[..., None, :, :]
    weight = np.divide(total - own, total, out=np.ones_like(total), where=total > 0)
    sampling = np.divide(variance, total, out=np.full_like(total, np.nan), where=total > 0)
    pooled_part = np.divide(variance, pooled_count, out=np.full_like(total, np.nan), where=pooled_count > 0)
    errors = np.sqrt(sampling + weight**2 * pooled_part)
    # Fewer than two observations in all: no variance is known yet.
    errors = np.where(pooled_count - 1 >= 1, errors, np.nan)
    return Estimate(means=means, standard_errors=errors)


# ----------------------------------------------------------------------------- the joint LP
def _check_scopes(objective: Objective, scopes) -> tuple[str, ...]:
    scopes = tuple(scopes)
    if len(scopes) != len(objective.guardrails):
        raise ValueError(
            f"Give one scope per guardrail ({len(objective.guardrails)}), got {len(scopes)}: {list(scopes)}."
        )
    for index, scope in enumerate(scopes):
        if scope not in SCOPES:
            raise ValueError(f"The scope of guardrail {index} must be one of {list(SCOPES)}, got {scope!r}.")
    soft = [g.metric for g in objective.guardrails if not g.hard]
    if soft:
        raise ValueError(
            f"The joint segment problem is a linear program and takes hard guardrails only; the guardrail(s) "
            f"on {soft} are soft (penalised). Give them 'hard': true."
        )
    return scopes


def check_scopes(objective: Objective, scopes) -> tuple[str, ...]:
    """The scopes as a tuple, or a ``ValueError`` sentence: one scope per guardrail, each in
    :data:`SCOPES`, and hard guardrails only (the joint problem is a linear program)."""
    return _check_scopes(objective, scopes)


@dataclass(frozen=True)
class JointSolution:
    """The optimum of the joint per-segment problem.

    Attributes
    ----------
    probabilities : ndarray, shape (S, K)
        p*_s per segment.
    value : float
        sum_s w_s a . (means_s p*_s), the traffic-weighted primary value.
    feasible : bool
        False when no choice of mixtures meets every guardrail; the mixtures then minimise the largest
        shortfall t* (in each metric's units) and are the best among those meeting c - t*.
    largest_shortfall : float
        t* (0 when feasible).
    global_shadow_prices : ndarray, shape (G,)
        Primary units gained per unit a global guardrail's threshold is lowered (0 for per-segment or
        non-binding guardrails; nan when infeasible).
    global_values : ndarray, shape (G,)
        sum_s w_s g_j . (constraint_means_s p*_s) for every guardrail.
    thresholds : ndarray, shape (S, G)
        The thresholds in force: per segment for segment-scoped guardrails, the global c_j repeated
        for global ones.
    """

    probabilities: np.ndarray
    value: float
    feasible: bool
    largest_shortfall: float
    global_shadow_prices: np.ndarray
    global_values: np.ndarray
    thresholds: np.ndarray


def _validate_shares(shares, n_segments: int) -> np.ndarray:
    shares = np.asarray(shares, dtype=float)
    if shares.shape != (n_segments,):
        raise ValueError(f"The traffic shares must have one entry per segment, shape ({n_segments},), got {shares.shape}.")
    if not np.all(np.isfinite(shares)) or np.any(shares < 0) or not math.isclose(shares.sum(), 1.0, abs_tol=1e-9):
        raise ValueError(f"The traffic shares must be non-negative and sum to 1, got {shares.tolist()}.")
    return shares


def resolve_thresholds(objective: Objective, means: np.ndarray, shares: np.ndarray, scopes) -> np.ndarray:
    """Thresholds (..., S, G): segment-scoped resolved on means_s, global ones on sum_s w_s means_s."""
    means = np.asarray(means, dtype=float)
    per_segment = objective.thresholds(means)
    platform = objective.thresholds(np.einsum("s,...smk->...mk", shares, means))
    is_global = np.array([scope == "global" for scope in scopes], dtype=bool)
    return np.where(is_global, platform[..., None, :], per_segment)


def solve_joint(
    objective: Objective,
    means: np.ndarray,
    shares: np.ndarray,
    scopes,
    *,
    constraint_means: np.ndarray | None = None,
    thresholds: np.ndarray | None = None,
    fixed: np.ndarray | None = None,
) -> JointSolution:
    """Solve the joint problem (module doc) exactly as one LP over the S x K mixture entries.

    Parameters
    ----------
    objective : Objective
        Hard guardrails only (see the module doc).
    means : ndarray, shape (S, M, K)
        Means used for the primary metric.
    shares : ndarray, shape (S,)
        Traffic shares w_s (sum 1).
    scopes : sequence of {"segment", "global"}, length G
    constraint_means : ndarray, shape (S, M, K), optional
        Means used for the guardrails (e.g. lower confidence bounds); defaults to ``means``.
    thresholds : ndarray, shape (S, G), optional
        Defaults to :func:`resolve_thresholds` on ``means``.
    fixed : ndarray, shape (S, K), optional
        Rows that are not nan fix that segment's mixture (a segment serving the global mixture).

    Returns
    -------
    JointSolution
    """
    scopes = _check_scopes(objective, scopes)
    means = np.asarray(means, dtype=float)
    if means.ndim != 3 or means.shape[1] != objective.n_metrics:
        raise ValueError(f"The means must have shape (S, {objective.n_metrics}, K), got {means.shape}.")
    n_segments, _, n_arms = means.shape
    shares = _validate_shares(shares, n_segments)
    constraint_means = means if constraint_means is None else np.asarray(constraint_means, dtype=float)
    if constraint_means.shape != means.shape or not (np.all(np.isfinite(means)) and np.all(np.isfinite(constraint_means))):
        raise ValueError(f"The means and constraint means must be finite arrays of shape {means.shape}.")
    if thresholds is None:
        thresholds = resolve_thresholds(objective, means, shares, scopes)
    thresholds = np.asarray(thresholds, dtype=float)
    n = n_segments * n_arms
    # Variable order: segment-major, x[s * K + k] = p_s[k]; the last variable is the shortfall t.
    cost = np.zeros(n + 1)
    cost[:n] = -(shares[:, None] * np.einsum("m,smk->sk", objective.primary_weights, means)).ravel()
    rows, rhs, global_rows = [], [], {}
    rows_g = objective.guardrail_rows
    for j, scope in enumerate(scopes):
        guarded = constraint_means[:, rows_g[j], :]  # (S, K)
        if scope == "global":
            row = np.zeros(n + 1)
            row[:n] = -(shares[:, None] * guarded).ravel()
            row[n] = -1.0
            global_rows[j] = len(rows)
            rows.append(row)
            rhs.append(-thresholds[0, j])
        else:
            for s in range(n_segments):
                row = np.zeros(n + 1)
                row[s * n_arms:(s + 1) * n_arms] = -guarded[s]
                row[n] = -1.0
                rows.append(row)
                rhs.append(-thresholds[s, j])
    equality = np.zeros((n_segments, n + 1))
    for s in range(n_segments):
        equality[s, s * n_arms:(s + 1) * n_arms] = 1.0
    bounds = [(0.0, None)] * n + [(0.0, 0.0)]
    if fixed is not None:
        fixed = np.asarray(fixed, dtype=float)
        for s in range(n_segments):
            if not np.any(np.isnan(fixed[s])):
                for k in range(n_arms):
                    bounds[s * n_arms + k] = (fixed[s, k], fixed[s, k])
    a_ub = np.array(rows) if rows else None
    b_ub = np.array(rhs) if rows else None
    ones = np.ones(n_segments)

    def run(c, bnds):
        lower = np.array([np.nan if low is None else low for low, _ in bnds])
        upper = np.array([np.nan if high is None else high for _, high in bnds])
        return linear_program(c, a_ub, b_ub, equality, ones, lower, upper)

    feasible, solution, duals = run(cost, bounds)
    shortfall = 0.0
    if not feasible:
        # Phase one: the smallest largest shortfall t*, then the best mixtures meeting c - t*.
        phase_one = np.zeros(n + 1)
        phase_one[n] = 1.0
        solved, first, _ = run(phase_one, bounds[:n] + [(0.0, None)])
        if not solved:
            raise RuntimeError("HiGHS could not solve the joint segment problem.")
        shortfall = float(first[n])
        relaxed = shortfall + 1e-9 * (1.0 + abs(shortfall))
        solved, solution, duals = run(cost, bounds[:n] + [(0.0, relaxed)])
        if not solved:
            raise RuntimeError("HiGHS could not solve the relaxed joint segment problem.")
    x = np.maximum(solution[:n], 0.0).reshape(n_segments, n_arms)
    probabilities = x / x.sum(axis=1, keepdims=True)
    prices = np.zeros(len(scopes))
    for j, row in global_rows.items():
        # The duals are d(min cost)/d(b_ub); lowering c_j raises b_ub by w... here b = -c.
        prices[j] = -duals[row] if feasible else np.nan
    if not feasible:
        prices[:] = np.nan
    guarded_values = np.einsum("s,sgk,sk->g", shares, constraint_means[:, rows_g, :], probabilities)
    value = float(np.einsum("s,m,smk,sk->", shares, objective.primary_weights, means, probabilities))
    return JointSolution(
        probabilities=probabilities,
        value=value,
        feasible=bool(feasible),
        largest_shortfall=shortfall,
        global_shadow_prices=prices,
        global_values=guarded_values,
        thresholds=thresholds,
    )


def global_mixture(objective: Objective, means: np.ndarray, shares: np.ndarray, scopes) -> np.ndarray:
    """The best single mixture served to every segment (K,) under the joint problem's guardrails."""
    means = np.asarray(means, dtype=float)
    n_segments = means.shape[0]
    tied = _solve_tied(objective, means, _validate_shares(shares, n_segments), _check_scopes(objective, scopes))
    return tied


def _solve_tied(objective, means, shares, scopes) -> np.ndarray:
    """One p for all segments: segment-scoped guardrails hold in every segment, global ones on average."""
    platform = np.einsum("s,smk->mk", shares, means)
    if all(scope == "global" for scope in scopes):
        return solve(objective, platform).probabilities
    thresholds = resolve_thresholds(objective, means, shares, scopes)
    n_segments, _, n_arms = means.shape
    # The tied problem is the joint LP on one segment whose rows stack the per-segment constraints.
    cost = -(objective.primary_weights @ platform)
    rows, rhs = [], []
    for j, scope in enumerate(scopes):
        row_index = objective.guardrail_rows[j]
        if scope == "global":
            rows.append(-platform[row_index])
            rhs.append(-thresholds[0, j])
        else:
            for s in range(n_segments):
                rows.append(-means[s, row_index])
                rhs.append(-thresholds[s, j])
    solved, x, _ = linear_program(cost, np.array(rows), np.array(rhs), np.ones((1, n_arms)), [1.0])
    if not solved:
        return solve(objective, platform).probabilities
    p = np.maximum(x, 0.0)
    return p / p.sum()


def segmented_values(
    objective: Objective, means: np.ndarray, shares: np.ndarray, probabilities: np.ndarray, thresholds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Platform value, global guardrail slack and per-segment primary of per-segment mixtures.

    Parameters
    ----------
    means : ndarray, shape (..., S, M, K)
    shares : ndarray, shape (S,)
    probabilities : ndarray, shape (..., S, K)
    thresholds : ndarray, shape (..., S, G)
        From :func:`resolve_thresholds`.

    Returns
    -------
    (ndarray, ndarray, ndarray)
        sum_s w_s a . (means_s p_s) (...); per guardrail sum_s w_s (y_{s,j} - c_{s,j}) (..., G);
        a . (means_s p_s) per segment (..., S).
    """
    x = np.einsum("...smk,...sk->...sm", means, probabilities)
    primary = x @ objective.primary_weights
    platform = np.einsum("s,...s->...", shares, primary)
    slack = np.einsum("s,...sg->...g", shares, x[..., objective.guardrail_rows] - thresholds)
    return platform, slack, primary


# ----------------------------------------------------------------------------- the controller
@dataclass(frozen=True)
class SegmentedConfig:
    """Configuration of the segmented controller.

    Attributes
    ----------
    algorithm : AlgorithmConfig
        The per-segment controller (:mod:`pasto.algorithm`), run on the segment batch.
    scopes : tuple of {"segment", "global"}
        Scope of each guardrail of the objective.
    shrink : bool
        Shrink segment estimates toward the pooled means (empirical Bayes); False is the ablation.
    confidence_z : float
        Pessimism for the constraints (0: the plug-in estimate). A segment-scoped guardrail is held
        on means - z * standard error; a global one on the estimate with its threshold raised by
        z times the standard error of the platform value sum_s w_s g . (V_s p_s) at the previous
        joint mixtures (segments' errors independent), which keeps the joint problem an LP and is
        not S times too cautious as entrywise bounds would be.
    """

    algorithm: algorithm.AlgorithmConfig = field(default_factory=algorithm.AlgorithmConfig)
    scopes: tuple[str, ...] = ()
    shrink: bool = True
    confidence_z: float = 2.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scopes", tuple(self.scopes))
        for scope in self.scopes:
            if scope not in SCOPES:
                raise ValueError(f"Every guardrail scope must be one of {list(SCOPES)}, got {scope!r}.")
        if not (isinstance(self.confidence_z, (int, float)) and math.isfinite(self.confidence_z) and self.confidence_z >= 0):
            raise ValueError(f"confidence_z must be a finite number >= 0, got {self.confidence_z!r}.")

    def to_dict(self) -> dict:
        return {
            "algorithm": self.algorithm.to_dict(),
            "scopes": list(self.scopes),
            "shrink": self.shrink,
            "confidence_z": self.confidence_z,
        }

    @classmethod
    def from_dict(cls, data: dict) -> SegmentedConfig:
        """Inverse of :meth:`to_dict`: ``SegmentedConfig.from_dict(c.to_dict()) == c``."""
        unknown = sorted(set(data) - {"algorithm", "scopes", "shrink", "confidence_z"})
        if unknown:
            raise ValueError(f"Unknown segmented configuration key(s) {unknown}.")
        return cls(
            algorithm=algorithm.AlgorithmConfig.from_dict(dict(data.get("algorithm", {}))),
            scopes=tuple(data.get("scopes", ())),
            shrink=bool(data.get("shrink", True)),
            confidence_z=data.get("confidence_z", 2.0),
        )


@dataclass(frozen=True)
class SegmentedState:
    """State of the segmented controller.

    Attributes
    ----------
    controller : ControllerState
        The per-segment controller's state, batch shape (..., S).
    joint : ndarray, shape (..., S, K)
        The last joint solution (uniform before the first).
    """

    controller: algorithm.ControllerState
    joint: np.ndarray

    def to_dict(self) -> dict:
        """JSON-friendly dict: the per-segment controller's :meth:`ControllerState.to_dict` (arrays
        with the segment axis) and the joint mixtures as nested lists."""
        return {"controller": self.controller.to_dict(), "joint": np.asarray(self.joint).tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> SegmentedState:
        """Inverse of :meth:`to_dict` (arrays compare equal after the round trip)."""
        missing = [key for key in ("controller", "joint") if key not in data]
        if missing:
            raise ValueError(f"The segmented state is missing the key(s) {missing}.")
        unknown = sorted(set(data) - {"controller", "joint"})
        if unknown:
            raise ValueError(f"The segmented state has unknown key(s) {unknown}.")
        controller = algorithm.ControllerState.from_dict(data["controller"])
        joint = np.asarray(data["joint"], dtype=float)
        if joint.shape != controller.probabilities.shape:
            raise ValueError(
                f"The joint mixtures have shape {joint.shape}, the served ones {controller.probabilities.shape}; "
                "they must agree (segments x arms)."
            )
        return cls(controller=controller, joint=joint)

    @property
    def n_segments(self) -> int:
        """S, the number of segments."""
        return int(self.joint.shape[-2])

    @property
    def probabilities(self) -> np.ndarray:
        """(..., S, K) the mixtures served now, per segment."""
        return self.controller.probabilities

    @property
    def deployed(self) -> np.ndarray:
        """(..., S, K) the mixtures recommended now, per segment."""
        return self.controller.deployed


def initial_segmented_state(
    config: SegmentedConfig, n_segments: int, n_arms: int, n_metrics: int, batch_shape: tuple[int, ...] = ()
) -> SegmentedState:
    """The state before round 1: every segment uniform."""
    batch = tuple(batch_shape) + (int(n_segments),)
    controller = algorithm.initial_state(config.algorithm, n_arms, n_metrics, batch)
    return SegmentedState(controller=controller, joint=np.full(batch + (n_arms,), 1.0 / n_arms))


def aggregate_state(state: SegmentedState, shares: np.ndarray) -> algorithm.ControllerState:
    """The traffic-weighted aggregate of a (unbatched) segmented state, as one ``ControllerState``.

    What the platform as a whole is served: probabilities, deployed mixture and schedule sums are
    sum_s w_s x_s; the estimator accumulators are per segment and left out (None), so estimates on the
    aggregate read pooled statistics.

    Parameters
    ----------
    state : SegmentedState
        Batch shape (S,): arrays (S, K).
    shares : ndarray, shape (S,)
        Traffic shares w_s (sum 1).

    Returns
    -------
    ControllerState
        Arrays (K,) (guardrail weights (G,)).
    """
    controller = state.controller
    shares = _validate_shares(shares, state.n_segments)
    deployed = shares @ controller.deployed
    log_deployed = np.log(np.maximum(deployed, np.exp(-700.0)))
    return algorithm.ControllerState(
        round_index=controller.round_index,
        probabilities=shares @ controller.probabilities,
        deployed=deployed,
        log_weights=log_deployed - np.log(np.exp(log_deployed).sum()),
        probability_sum=shares @ controller.probability_sum,
        stage_probability_sum=shares @ controller.stage_probability_sum,
        gradient_square_sum=np.asarray(shares @ np.asarray(controller.gradient_square_sum, dtype=float)),
        guardrail_weights=shares @ controller.guardrail_weights,
        history=None,
        baseline=None,
        discounted=None,
    )


def add_segments(state: SegmentedState, count: int, template: int = 0) -> SegmentedState:
    """``state`` with ``count`` more segments at the end, each starting as a copy of segment ``template``.

    For an open set of segment values: a value that reaches its unit threshold gets its own mixture,
    starting from the mixture its traffic had (the template's: the long tail's shared segment) with
    that segment's schedule and accumulators; its estimate then comes from its own statistics
    (shrunk toward the pooled means) and the joint solve. Unbatched states only.

    Parameters
    ----------
    state : SegmentedState
        Batch shape (S,).
    count : int
        Segments to add (>= 0).
    template : int
        Position of the segment copied.

    Returns
    -------
    SegmentedState
        Batch shape (S + count,).
    """
    if count < 0:
        raise ValueError(f"The number of segments to add must be >= 0, got {count}.")
    n_segments = state.n_segments
    if state.joint.ndim != 2:
        raise ValueError("add_segments takes an unbatched segmented state (arrays of shape (S, K)).")
    if not 0 <= template < n_segments:
        raise ValueError(f"The template segment must be one of 0..{n_segments - 1}, got {template}.")
    if count == 0:
        return state

    def grown(array):
        if array is None:
            return None
        array = np.asarray(array)
        return np.concatenate([array, np.repeat(array[template:template + 1], count, axis=0)], axis=0)

    controller = state.controller
    history = controller.history
    if history is not None:
        history = type(history)(grown(history.sums), grown(history.sums_of_squares), grown(history.weights))
    discounted = controller.discounted
    if discounted is not None:
        discounted = Statistics(grown(discounted.counts), grown(discounted.sums), grown(discounted.sums_of_squares))
    return SegmentedState(
        controller=algorithm.ControllerState(
            round_index=controller.round_index,
            probabilities=grown(controller.probabilities),
            deployed=grown(controller.deployed),
            log_weights=grown(controller.log_weights),
            probability_sum=grown(controller.probability_sum),
            stage_probability_sum=grown(controller.stage_probability_sum),
            gradient_square_sum=grown(controller.gradient_square_sum),
            guardrail_weights=grown(controller.guardrail_weights),
            history=history,
            baseline=grown(controller.baseline),
            discounted=discounted,
        ),
        joint=grown(state.joint),
    )


def measured_shares(counts: np.ndarray, expected: np.ndarray | None = None) -> np.ndarray:
    """Traffic shares (S,) from observation counts per segment (S,): the measured ones once there is any
    observation, else ``expected`` (else equal shares)."""
    counts = np.asarray(counts, dtype=float)
    total = counts.sum()
    if total > 0:
        return counts / total
    if expected is not None:
        return np.asarray(expected, dtype=float)
    return np.full(counts.shape, 1.0 / counts.size)


def joint_exploration(config: SegmentedConfig) -> algorithm.ExplorationConfig:
    """The options of the joint step (several segments): its re-solve period and exploration rate.

    They are the exploration controller's; a safe per-segment controller has none, so the joint
    step then takes the exploration controller's defaults.
    """
    return algorithm.ExplorationConfig() if config.algorithm.safe else config.algorithm.exploration


def segmented_update(
    config: SegmentedConfig,
    objective: Objective,
    state: SegmentedState,
    round_statistics: Statistics,
    pooled_statistics: Statistics,
    shares: np.ndarray,
    propensities: np.ndarray | None = None,
    *,
    rng: np.random.Generator | None = None,
) -> SegmentedState:
    """Close one round of the segmented controller.

    Parameters
    ----------
    config : SegmentedConfig
    objective : Objective
    state : SegmentedState
    round_statistics, pooled_statistics : Statistics, shape (..., S, M, K)
        The closing round's observations and every observation so far, per segment.
    shares : ndarray, shape (S,)
        Traffic shares w_s.
    propensities : ndarray, shape (..., S, K), optional
        Defaults to ``state.probabilities``.
    rng : numpy.random.Generator, optional
        Passed to :func:`pasto.algorithm.update` (safe serving's posterior draws, one segment).

    Returns
    -------
    SegmentedState
        With one segment: exactly :func:`pasto.algorithm.update` (nothing to shrink or couple).
    """
    n_segments = state.joint.shape[-2]
    shares = _validate_shares(shares, n_segments)
    effective = shrink(pooled_statistics) if config.shrink else pooled_statistics
    # With several segments the joint step below replaces the served and deployed mixtures and the
    # weights: safe serving's own choice of them (nine LPs per segment and run) would be discarded.
    controller = algorithm.update(
        config.algorithm, objective, state.controller, round_statistics, effective, propensities,
        rng=rng, choose_mixtures=n_segments == 1,
    )
    if n_segments == 1:
        return SegmentedState(controller=controller, joint=controller.deployed)
    scopes = _check_scopes(objective, config.scopes)
    t = controller.round_index
    rule = joint_exploration(config)
    solve_every = max(rule.solve_every, 1)
    joint = state.joint
    if t == 1 or t % solve_every == 0:
        joint = _joint_step(config, objective, scopes, pooled_statistics, shares, state.joint)
    eps = algorithm.exploration_rate(rule, t + 1)
    n_arms = joint.shape[-1]
    probabilities = (1.0 - eps) * joint + eps / n_arms
    log_weights = np.log(np.maximum(joint, np.exp(-700.0)))
    controller = algorithm.ControllerState(
        round_index=controller.round_index,
        probabilities=probabilities,
        deployed=joint.copy(),
        log_weights=log_weights - np.log(np.exp(log_weights).sum(axis=-1, keepdims=True)),
        probability_sum=controller.probability_sum,
        stage_probability_sum=controller.stage_probability_sum,
        gradient_square_sum=controller.gradient_square_sum,
        guardrail_weights=controller.guardrail_weights,
        history=controller.history,
        baseline=controller.baseline,
        discounted=controller.discounted,
    )
    return SegmentedState(controller=controller, joint=joint)


def _joint_step(config, objective, scopes, pooled_statistics, shares, previous) -> np.ndarray:
    """The joint LP per batch entry on the (shrunk) estimate; segments without data get the global mixture.

    ``previous`` (..., S, K) are the last joint mixtures, at which the platform value's standard
    error is evaluated.
    """
    current = shrunk_estimate(pooled_statistics, config.shrink)
    errors = np.nan_to_num(current.standard_errors, nan=0.0)
    is_global = np.array([scope == "global" for scope in scopes], dtype=bool)
    rows = objective.guardrail_rows
    # Segment-scoped guardrails: entrywise lower bounds (pessimism only for the guardrails).
    lower = current.means.copy()
    segment_rows = rows[~is_global]
    lower[..., segment_rows, :] -= config.confidence_z * errors[..., segment_rows, :]
    # Global guardrails: threshold + z * sqrt(sum_s w_s^2 sum_k p_sk^2 se_sjk^2) (see below).
    batch = current.means.shape[:-3]
    n_segments, _, n_arms = current.means.shape[-3:]
    no_data = pooled_statistics.counts.sum(axis=(-2, -1)) == 0  # (..., S)
    platform = pooled_estimate(pool_segments(pooled_statistics)).means
    joint = np.empty(batch + (n_segments, n_arms))
    for index in np.ndindex(*batch):
        fixed = None
        if np.any(no_data[index]):
            tied = _solve_tied(objective, np.repeat(platform[index][None], n_segments, axis=0), shares, scopes)
            fixed = np.where(no_data[index][:, None], tied[None, :], np.nan)
        resolved = resolve_thresholds(objective, current.means[index], shares, scopes)
        mixtures = previous[index]
        # The margin depends on the mixtures it constrains: evaluated at the previous joint
        # mixtures, then once more at the answer (one fixed-point step).
        for _ in range(2):
            platform_error = np.sqrt(
                np.einsum("s,sgk,sk->g", shares**2, errors[index][:, rows, :] ** 2, mixtures**2)
            )
            margin = np.where(is_global, config.confidence_z * platform_error, 0.0)
            mixtures = solve_joint(
                objective, current.means[index], shares, scopes,
                constraint_means=lower[index], thresholds=resolved + margin, fixed=fixed,
            ).probabilities
        joint[index] = mixtures
    return joint


# ----------------------------------------------------------------------------- reporting
@dataclass(frozen=True)
class SegmentReport:
    """How a segmented controller is doing on its current (shrunk) estimate; no batch dimensions.

    Attributes
    ----------
    estimate : Estimate
        Per-segment estimate, (S, M, K) (:func:`shrunk_estimate`).
    shares : ndarray, shape (S,)
    thresholds : ndarray, shape (S, G)
        From :func:`resolve_thresholds` on the estimate.
    segment_values : ndarray, shape (S,)
        a . (means_s p_s) of each segment's deployed mixture.
    platform_value : float
        sum_s w_s a . (means_s p_s) of the deployed per-segment mixtures.
    global_mixture : ndarray, shape (K,)
        The best single mixture for every segment under the same guardrails (:func:`global_mixture`).
    global_value : float
        Its platform value.
    gain : float
        platform_value - global_value: what segmenting gains over one global mixture.
    gain_interval : ndarray, shape (2,)
        95% interval of the gain (delta method, mixtures held fixed, cells independent).
    guardrails : tuple of dict
        Per segment (S entries), :func:`pasto.diagnostics.guardrail_report` of its deployed mixture on
        its own estimate.
    platform_guardrails : tuple of dict
        Per guardrail: the traffic-weighted platform value sum_s w_s g_j . (means_s p_s), its 95%
        interval, the threshold in force (global: c_j; segment-scoped: sum_s w_s c_{s,j}), the scope, and
        whether it holds.
    """

    estimate: Estimate
    shares: np.ndarray
    thresholds: np.ndarray
    segment_values: np.ndarray
    platform_value: float
    global_mixture: np.ndarray
    global_value: float
    gain: float
    gain_interval: np.ndarray
    guardrails: tuple
    platform_guardrails: tuple


def segment_report(
    config: SegmentedConfig, objective: Objective, deployed: np.ndarray, pooled_statistics: Statistics, shares
) -> SegmentReport:
    """Per-segment values and guardrails, the platform-wide guardrails and the gain of segmenting.

    Parameters
    ----------
    config : SegmentedConfig
    objective : Objective
    deployed : ndarray, shape (S, K)
        The per-segment mixtures to report on.
    pooled_statistics : Statistics, shape (S, M, K)
    shares : ndarray, shape (S,)
    """
    scopes = _check_scopes(objective, config.scopes)
    deployed = np.asarray(deployed, dtype=float)
    n_segments, n_arms = deployed.shape
    shares = _validate_shares(shares, n_segments)
    current = shrunk_estimate(pooled_statistics, config.shrink)
    means = current.means
    errors = np.nan_to_num(current.standard_errors, nan=0.0)
    thresholds = resolve_thresholds(objective, means, shares, scopes)
    platform, _, primary = segmented_values(objective, means, shares, deployed, thresholds)
    tied = _solve_tied(objective, means, shares, scopes)
    tied_value = float(segmented_values(objective, means, shares, np.broadcast_to(tied, deployed.shape), thresholds)[0])
    gain = float(platform) - tied_value
    weights = objective.primary_weights
    gain_variance = float(np.einsum("s,m,smk,sk->", shares**2, weights**2, errors**2, (deployed - tied[None, :]) ** 2))
    half = 1.959963984540054 * math.sqrt(gain_variance)
    per_segment = tuple(
        tuple(guardrail_report(objective, Estimate(means[s], current.standard_errors[s]), deployed[s]))
        for s in range(n_segments)
    )
    platform_rows = []
    rows = objective.guardrail_rows
    for j, (guardrail, scope) in enumerate(zip(objective.guardrails, scopes)):
        values = np.einsum("sk,sk->s", means[:, rows[j], :], deployed)
        value = float(shares @ values)
        error = math.sqrt(float(np.einsum("s,sk,sk->", shares**2, errors[:, rows[j], :] ** 2, deployed**2)))
        threshold = float(thresholds[0, j]) if scope == "global" else float(shares @ thresholds[:, j])
        platform_rows.append({
            "metric": guardrail.metric, "scope": scope, "threshold": threshold, "estimate": value,
            "interval": [value - 1.959963984540054 * error, value + 1.959963984540054 * error],
            "holds": bool(value >= threshold),
        })
    return SegmentReport(
        estimate=current, shares=shares, thresholds=thresholds, segment_values=np.asarray(primary),
        platform_value=float(platform), global_mixture=tied, global_value=tied_value, gain=gain,
        gain_interval=np.array([gain - half, gain + half]), guardrails=per_segment,
        platform_guardrails=tuple(platform_rows),
    )
