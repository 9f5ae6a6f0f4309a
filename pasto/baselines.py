"""Baselines the simulator compares PASTO against.

- **S-SCGD** (the paper's Fig. 3; Wang, Fang & Liu 2017): the same exponentiated-gradient update as
  Algorithm 1, but the gradient uses the single-round inverse-propensity estimate U_t with a tracked
  inner value instead of the history average: ``y_t = (1 - b_t) y_{t-1} + b_t U_t p_t``,
  ``g_t = U_t^T grad f(y_t)``, ``b_t = t^(-tracking_exponent)``.
- **Thompson sampling on the scalarised objective**: what a user of an A/B-testing or bandit
  platform would run. Every arm gets a Gaussian posterior per metric; each draw scores every arm
  by f of its own sampled metric vector (the objective of serving that arm alone) and picks the
  best. It converges to one arm, so it can at best match the best single arm.
- **Oracle best single arm**: the arm with the highest f under the true means; the ceiling of any
  deterministic (one-arm) answer, against which relative gain is measured.

The two learning baselines follow the controller contract of ``pasto.algorithm``
(``initial_state(config, n_arms, n_metrics, batch_shape)`` and ``update(config, objective, state,
round_statistics, pooled_statistics, propensities)``) with leading batch dimensions, so the
simulator runs them exactly like the PASTO presets. Thompson sampling draws from its posterior, so
its ``update`` also takes the ``rng``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pasto.estimators import Statistics
    from pasto.objectives import Objective

__all__ = [
    "ScgdConfig",
    "ScgdState",
    "scgd_initial_state",
    "scgd_update",
    "ThompsonConfig",
    "ThompsonState",
    "thompson_initial_state",
    "thompson_update",
]


def _config_from_dict(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ValueError(
                f"Unknown {cls.__name__} setting {key!r}; the settings are {', '.join(sorted(names))}."
            )
    return cls(**data)


def _positive(value: Any, name: str, owner: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ValueError(f"{owner}.{name} must be a finite number, not {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "at least 0" if allow_zero else "positive"
        raise ValueError(f"{owner}.{name} must be {bound}, not {value!r}.")
    return float(value)


# --------------------------------------------------------------------------- S-SCGD


@dataclass(frozen=True)
class ScgdConfig:
    """Settings of the S-SCGD baseline; the defaults are the paper's simulation settings.

    Attributes
    ----------
    step_size : float or None
        gamma; ``None`` means the paper's 0.1 / K.
    exploration_scale, exploration_offset : float
        eps_t = exploration_scale / sqrt(t + exploration_offset) (paper: 0.1 and 10).
    tracking_exponent : float
        b_t = t^(-tracking_exponent), in (0, 1]; 0.5 is the basic SCGD's inner step.
    """

    step_size: float | None = None
    exploration_scale: float = 0.1
    exploration_offset: float = 10.0
    tracking_exponent: float = 0.5

    def __post_init__(self) -> None:
        if self.step_size is not None:
            _positive(self.step_size, "step_size", "ScgdConfig")
        scale = _positive(self.exploration_scale, "exploration_scale", "ScgdConfig", allow_zero=True)
        offset = _positive(self.exploration_offset, "exploration_offset", "ScgdConfig", allow_zero=True)
        if scale / np.sqrt(1.0 + offset) > 1.0:
            raise ValueError(
                "ScgdConfig.exploration_scale / sqrt(1 + exploration_offset) must be at most 1 "
                "(eps_t is a probability share)."
            )
        exponent = _positive(self.tracking_exponent, "tracking_exponent", "ScgdConfig")
        if exponent > 1.0:
            raise ValueError(f"ScgdConfig.tracking_exponent must be in (0, 1], not {exponent}.")

    def exploration(self, round_number: int) -> float:
        """eps_t for the 1-based round t."""
        return self.exploration_scale / np.sqrt(round_number + self.exploration_offset)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ScgdConfig":
        return _config_from_dict(cls, data)


@dataclass(frozen=True)
class ScgdState:
    """Learned state of S-SCGD.

    Attributes
    ----------
    round_index : int
        0-based index of the round now being served.
    probabilities : ndarray, shape (..., K)
        p_t served in the current round.
    deployed : ndarray, shape (..., K)
        Average of the served p since the start (the paper's deploy rule).
    log_weights : ndarray, shape (..., K)
    tracked : ndarray, shape (..., M)
        y_t, the running estimate of the inner value mu p.
    probability_sum : ndarray, shape (..., K)
        Sum of the served p, for ``deployed``.
    """

    round_index: int
    probabilities: np.ndarray
    deployed: np.ndarray
    log_weights: np.ndarray
    tracked: np.ndarray
    probability_sum: np.ndarray


def _mix(config_exploration: float, log_weights: np.ndarray) -> np.ndarray:
    shifted = log_weights - log_weights.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    weights /= weights.sum(axis=-1, keepdims=True)
    n_arms = log_weights.shape[-1]
    return (1.0 - config_exploration) * weights + config_exploration / n_arms


def scgd_initial_state(
    config: ScgdConfig, n_arms: int, n_metrics: int, batch_shape: tuple[int, ...] = ()
) -> ScgdState:
    """The state before round 1: uniform weights, y_0 = 0."""
    log_weights = np.zeros(batch_shape + (n_arms,))
    probabilities = _mix(config.exploration(1), log_weights)
    return ScgdState(
        round_index=0,
        probabilities=probabilities,
        deployed=probabilities.copy(),
        log_weights=log_weights,
        tracked=np.zeros(batch_shape + (n_metrics,)),
        probability_sum=np.zeros(batch_shape + (n_arms,)),
    )


def scgd_update(
    config: ScgdConfig,
    objective: Objective,
    state: ScgdState,
    round_statistics: Statistics,
    pooled_statistics: Statistics,
    propensities: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> ScgdState:
    """Close round ``state.round_index`` and return the state for the next one.

    Parameters
    ----------
    round_statistics : Statistics
        Observations of the closing round (or of the round that just arrived, with delays); the
        arrays have shape (..., M, K).
    pooled_statistics : Statistics
        Observations so far; used only to resolve thresholds relative to a baseline arm.
    propensities : ndarray, shape (..., K), optional
        The p that ``round_statistics`` were sampled with; defaults to ``state.probabilities``.
    rng : ignored
        Accepted so that every baseline has the same signature.
    """
    del rng
    round_number = state.round_index + 1
    n_arms = state.log_weights.shape[-1]
    if propensities is None:
        propensities = state.probabilities
    counts = np.asarray(round_statistics.counts, dtype=float)
    sums = np.asarray(round_statistics.sums, dtype=float)
    # The round's n_t plays the role of Q; metrics may arrive in different numbers.
    observations = counts.sum(axis=-1)  # (..., M)
    has_data = observations > 0
    per_query = np.divide(sums, observations[..., None], out=np.zeros_like(sums), where=has_data[..., None])
    inverse_propensity = per_query / propensities[..., None, :]  # U_t, (..., M, K)

    step_tracking = round_number ** (-config.tracking_exponent)
    round_value = per_query.sum(axis=-1)  # U_t p_t: the round's plain mean of each metric
    tracked = np.where(has_data, (1.0 - step_tracking) * state.tracked + step_tracking * round_value, state.tracked)

    pooled_counts = np.asarray(pooled_statistics.counts, dtype=float)
    pooled_means = np.divide(
        pooled_statistics.sums, pooled_counts, out=np.zeros_like(pooled_counts), where=pooled_counts > 0
    )
    thresholds = objective.thresholds(pooled_means)
    gradient_metrics = objective.gradient(tracked, thresholds)  # (..., M)
    gradient = np.einsum("...mk,...m->...k", inverse_propensity, gradient_metrics)

    step = config.step_size if config.step_size is not None else 0.1 / n_arms
    log_weights = state.log_weights + step * gradient
    log_weights = log_weights - log_weights.max(axis=-1, keepdims=True)
    probability_sum = state.probability_sum + state.probabilities
    probabilities = _mix(config.exploration(round_number + 1), log_weights)
    return ScgdState(
        round_index=round_number,
        probabilities=probabilities,
        deployed=probability_sum / round_number,
        log_weights=log_weights,
        tracked=tracked,
        probability_sum=probability_sum,
    )


# --------------------------------------------------------------------------- Thompson sampling


@dataclass(frozen=True)
class ThompsonConfig:
    """Settings of the Thompson-sampling best-arm baseline.

    Attributes
    ----------
    draws : int
        Posterior draws per round; the served probabilities are the share of draws each arm wins
        (an unbiased estimate of the probability that the arm is best).
    fallback_variance : float
        Noise variance assumed per metric until two observations of some arm allow a pooled
        within-arm estimate.
    """

    draws: int = 16
    fallback_variance: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.draws, bool) or not isinstance(self.draws, int) or self.draws < 1:
            raise ValueError(f"ThompsonConfig.draws must be a positive integer, not {self.draws!r}.")
        _positive(self.fallback_variance, "fallback_variance", "ThompsonConfig")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ThompsonConfig":
        return _config_from_dict(cls, data)


@dataclass(frozen=True)
class ThompsonState:
    """Learned state of Thompson sampling (the posterior is recomputed from pooled statistics).

    Attributes
    ----------
    round_index : int
    probabilities : ndarray, shape (..., K)
        Share of this round's posterior draws won by each arm: what is served.
    deployed : ndarray, shape (..., K)
        One-hot on the arm with the best posterior-mean objective (the A/B platform's answer).
    """

    round_index: int
    probabilities: np.ndarray
    deployed: np.ndarray


def thompson_initial_state(
    config: ThompsonConfig, n_arms: int, n_metrics: int, batch_shape: tuple[int, ...] = ()
) -> ThompsonState:
    """Before any data every arm is equally likely to be best."""
    del config, n_metrics
    uniform = np.full(batch_shape + (n_arms,), 1.0 / n_arms)
    return ThompsonState(round_index=0, probabilities=uniform, deployed=uniform.copy())


def thompson_update(
    config: ThompsonConfig,
    objective: Objective,
    state: ThompsonState,
    round_statistics: Statistics,
    pooled_statistics: Statistics,
    propensities: np.ndarray | None = None,
    rng: np.random.Generator | None = None,
) -> ThompsonState:
    """Recompute the posterior from ``pooled_statistics`` and draw the next round's arms.

    Each arm's metric means get the posterior N(sample mean, sigma_m^2 / n) (flat prior, sigma_m^2
    the pooled within-arm variance of metric m). Arms not yet observed are tried first, uniformly
    at random. ``round_statistics`` and ``propensities`` are not needed: Thompson sampling does not
    reweight by propensity.
    """
    del round_statistics, propensities
    if rng is None:
        raise ValueError("thompson_update needs an rng (numpy Generator) to draw from its posterior.")
    counts = np.asarray(pooled_statistics.counts, dtype=float)  # (..., M, K)
    sums = np.asarray(pooled_statistics.sums, dtype=float)
    squares = np.asarray(pooled_statistics.sums_of_squares, dtype=float)
    observed = counts > 0
    means = np.divide(sums, counts, out=np.zeros_like(sums), where=observed)
    within = np.where(observed, squares - means * sums, 0.0).sum(axis=-1)  # (..., M)
    degrees = np.maximum(counts - 1.0, 0.0).sum(axis=-1)
    variance = np.divide(
        within, degrees, out=np.full_like(within, config.fallback_variance), where=degrees > 0
    )
    variance = np.maximum(variance, 1e-12)
    standard_errors = np.sqrt(variance[..., None] / np.maximum(counts, 1.0))

    batch_shape = counts.shape[:-2]
    n_metrics, n_arms = counts.shape[-2:]
    thresholds = objective.thresholds(means)  # (..., G)
    winners = _thompson_winners(objective, means, standard_errors, thresholds, config.draws, rng)

    unobserved = ~observed.all(axis=-2)  # (..., K): some metric never seen for the arm
    exploring = unobserved.any(axis=-1)
    if exploring.any():
        keys = np.where(unobserved[..., None, :], rng.random(batch_shape + (config.draws, n_arms)), -1.0)
        winners = np.where(exploring[..., None], np.argmax(keys, axis=-1), winners)

    one_hot = winners[..., None] == np.arange(n_arms)
    probabilities = one_hot.mean(axis=-2)

    point_scores = objective.value(np.swapaxes(means, -1, -2), thresholds[..., None, :])  # (..., K)
    point_scores = point_scores - _hard_shortfall_cost(objective, means, thresholds)
    point_scores = np.where(unobserved, -np.inf, point_scores)
    best = np.argmax(point_scores, axis=-1)
    deployed = np.where(
        exploring[..., None] & ~observed.any(axis=(-2, -1))[..., None],
        1.0 / n_arms,
        (best[..., None] == np.arange(n_arms)).astype(float),
    )
    return ThompsonState(round_index=state.round_index + 1, probabilities=probabilities, deployed=deployed)


# Posterior draws are made and scored in blocks of runs of about this many values, so that the
# samples stay in cache; the generator fills blocks in the same order as one call would.
_DRAW_BLOCK_VALUES = 1 << 16


def _thompson_winners(objective, means, standard_errors, thresholds, draws, rng):
    """Per run and draw, the arm whose sampled metric vector scores best; shape (..., draws).

    The samples mu ~ N(means, se^2), (..., draws, M, K), are drawn with one standard normal per
    entry in C order, block by block of runs (leading batch entries), which consumes the
    generator exactly as a single call of the full shape would.
    """
    batch_shape = means.shape[:-2]
    n_metrics, n_arms = means.shape[-2:]
    flat_means = means.reshape((-1, n_metrics, n_arms))
    flat_errors = standard_errors.reshape((-1, n_metrics, n_arms))
    runs = flat_means.shape[0]
    flat_thresholds = np.broadcast_to(thresholds, batch_shape + thresholds.shape[-1:]).reshape(
        (runs, thresholds.shape[-1])
    )
    winners = np.empty((runs, draws), dtype=np.intp)
    block = max(1, _DRAW_BLOCK_VALUES // (draws * n_metrics * n_arms))
    for start in range(0, runs, block):
        stop = min(runs, start + block)
        samples = rng.standard_normal((stop - start, draws, n_metrics, n_arms))
        samples *= flat_errors[start:stop, None, :, :]
        samples += flat_means[start:stop, None, :, :]
        scores = _arm_scores(objective, samples, flat_thresholds[start:stop, None, :])  # (b, draws, K)
        winners[start:stop] = np.argmax(scores, axis=-1)
    return winners.reshape(batch_shape + (draws,))


def _arm_scores(objective: Objective, samples: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """f of each arm's own metric vector: ``objective.value`` of samples (..., M, K) along M.

    Works on the contiguous (..., K) planes of each metric instead of transposing to (..., K, M),
    with preallocated buffers: the primary part sum_i a_i x_i is accumulated metric by metric
    (metrics with weight 0 add nothing) and the penalties lambda_j min(0, x_j - c_j)^2 are
    subtracted guardrail by guardrail. ``thresholds`` has shape (..., G), broadcastable against
    the leading dimensions of ``samples``. Returns (..., K).
    """
    plane_shape = samples.shape[:-2] + samples.shape[-1:]
    primary = -_hard_shortfall_cost(objective, samples, thresholds)
    term = np.empty(plane_shape)
    for metric, weight in enumerate(objective.primary_weights):
        if weight != 0.0:
            np.multiply(samples[..., metric, :], weight, out=term)
            primary += term
    if len(objective.guardrail_rows) == 0:
        return primary
    penalty = np.zeros(plane_shape)
    for j, (row, lam) in enumerate(zip(objective.guardrail_rows, objective.penalties)):
        if lam == 0.0:
            continue
        np.subtract(samples[..., row, :], thresholds[..., j, None], out=term)
        np.minimum(term, 0.0, out=term)
        np.square(term, out=term)
        term *= lam
        penalty += term
    primary -= penalty
    return primary


# An arm (sample) that breaks a hard guardrail ranks below every arm that keeps them all; among
# arms that break some, the smaller total shortfall (in units of the thresholds) ranks higher.
_HARD_RANK = 1e12


def _hard_shortfall_cost(objective: Objective, samples: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """_HARD_RANK times the relative shortfall of each arm's hard guardrails; samples (..., M, K) -> (..., K).

    Thompson sampling on a scalarised objective has no notion of a constraint; with hard guardrails
    a sampled arm that breaks one cannot be the best (as Ax drops infeasible posterior samples).
    """
    cost = np.zeros(samples.shape[:-2] + samples.shape[-1:])
    for j, guardrail in enumerate(objective.guardrails):
        if not getattr(guardrail, "hard", False):
            continue
        threshold = np.asarray(thresholds)[..., j, None]
        shortfall = np.maximum(0.0, threshold - samples[..., objective.guardrail_rows[j], :])
        cost = cost + _HARD_RANK * shortfall / np.maximum(np.abs(threshold), 1e-12)
    return cost
