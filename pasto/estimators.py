"""Estimates of the M x K mean matrix mu from sufficient statistics.

Observations arrive as per-metric, per-arm sufficient statistics (count, sum, sum of squares);
metrics may arrive separately, so counts are per metric. Three estimators are provided:

``ips`` (the paper's, Eq. 5-6 and Algorithm 1 line 5)
    Each round t gives the inverse-propensity estimate ``U_t[m, k] = sums_t[m, k] / (n_t[m] p_{t,k})``
    with ``n_t[m] = sum_k counts_t[m, k]`` (the paper's Q parallel queries, or every observation of
    the round in the service) and ``p_t`` the probabilities served when the round was sampled.
    ``E[U_t] = mu``. The estimate is the history average ``V_t = (U_0 + U_1 + ... + U_t) / (t + 1)``
    with ``U_0 = 0`` as in Algorithm 1 (``V_t = t/(t+1) V_{t-1} + U_t/(t+1)``).
``control_variate``
    ``U_t[m, k] = B[m, k] + (sums_t[m, k] - counts_t[m, k] B[m, k]) / (n_t[m] p_{t,k})`` with a
    baseline B fixed before the round was sampled (the algorithm uses the pooled means at the
    previous update). Still unbiased; the variance falls from ~mu_k^2 / p_k to ~(mu_k - B_k)^2 / p_k.
    The estimate is the plain average of the U_t (no U_0 term).
``pooled``
    Per-arm sample means sum / count over every observation so far (biased by nothing but the
    adaptivity of sampling; by far the lowest variance).

History averages are kept incrementally in a :class:`History` (discounted sums of U, of U^2, and
the discounted number of rounds), so an update costs O(M K). A discount factor delta in (0, 1]
down-weights old rounds (delta = 1: none): ``S <- delta S + U``, ``W <- delta W + 1``, estimate
S / W. The pooled estimator is discounted the same way through :func:`discount_statistics`.

Estimator objects
    The controller uses each estimator through one small frozen dataclass (:class:`IpsEstimator`,
    :class:`ControlVariateEstimator`, :class:`PooledEstimator`, chosen once by :func:`make_estimator`)
    with the three operations an update needs: ``start`` (the :class:`Accumulators` before round 1),
    ``absorb`` (take in one closed round) and ``estimate`` (the current :class:`Estimate`).

Arms without data
    An arm with no observation of a metric gets the mean of that metric over the arms that have
    data (0 if no arm has any); its standard error is nan. Under ``ips`` no fallback is needed:
    an unsampled arm's U is 0 by construction.

Standard errors
    pooled: sqrt(sample variance / count), defined for count >= 2. History averages: the sample
    standard deviation of the per-round U_t over sqrt(rounds), defined for more than one round
    (with a discount, rounds is the discounted weight W, an approximation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

__all__ = [
    "Statistics",
    "Estimate",
    "History",
    "pooled_estimate",
    "ips_round_estimate",
    "control_variate_round_estimate",
    "empty_history",
    "history_update",
    "history_estimate",
    "discount_statistics",
    "fill_missing",
    "Accumulators",
    "Estimator",
    "IpsEstimator",
    "ControlVariateEstimator",
    "PooledEstimator",
    "ESTIMATOR_NAMES",
    "make_estimator",
]


@dataclass(frozen=True)
class Statistics:
    """Sufficient statistics of observations.

    Attributes
    ----------
    counts : ndarray, shape (..., M, K)
        Number of observations per metric and arm.
    sums : ndarray, shape (..., M, K)
        Sum of the observed values.
    sums_of_squares : ndarray, shape (..., M, K)
        Sum of the squared observed values.
    """

    counts: np.ndarray
    sums: np.ndarray
    sums_of_squares: np.ndarray

    def __post_init__(self) -> None:
        arrays = [np.asarray(a, dtype=float) for a in (self.counts, self.sums, self.sums_of_squares)]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise ValueError(
                "counts, sums and sums_of_squares must have the same shape (..., M, K), got "
                f"{[a.shape for a in arrays]}."
            )
        if arrays[0].ndim < 2:
            raise ValueError(f"Statistics must have shape (..., M, K), got {arrays[0].shape}.")
        object.__setattr__(self, "counts", arrays[0])
        object.__setattr__(self, "sums", arrays[1])
        object.__setattr__(self, "sums_of_squares", arrays[2])

    @classmethod
    def zeros(cls, n_metrics: int, n_arms: int, batch_shape: tuple[int, ...] = ()) -> Statistics:
        """Statistics of no observations, shape batch_shape + (n_metrics, n_arms)."""
        shape = tuple(batch_shape) + (n_metrics, n_arms)
        return cls(np.zeros(shape), np.zeros(shape), np.zeros(shape))

    @classmethod
    def from_observations(
        cls, arms: np.ndarray, values: np.ndarray, n_arms: int
    ) -> Statistics:
        """Statistics of single observations.

        Parameters
        ----------
        arms : ndarray of int, shape (..., N)
            Arm of each observation.
        values : ndarray, shape (..., N, M)
            Observed metric values (nan = metric not observed).
        n_arms : int
            K.
        """
        values = np.asarray(values, dtype=float)
        arms = np.broadcast_to(np.asarray(arms, dtype=np.intp), values.shape[:-1])
        *batch, _, n_metrics = values.shape
        observed = ~np.isnan(values)
        clean = np.where(observed, values, 0.0)
        # One bincount per quantity over a flat (batch, metric, arm) cell index: O(N M) work and
        # memory, where a one-hot (N, K) matrix would be O(N K M) (the service ingests batches of
        # thousands of observations over up to 10,000 arms).
        batch_size = int(np.prod(batch, dtype=np.int64))
        rows = np.arange(batch_size).reshape(*batch, 1, 1) * n_metrics + np.arange(n_metrics)
        cells = (rows * n_arms + arms[..., None]).ravel()
        size = batch_size * n_metrics * n_arms
        shape = (*batch, n_metrics, n_arms)

        def total(weights: np.ndarray) -> np.ndarray:
            return np.bincount(cells, weights=weights.ravel(), minlength=size).reshape(shape)

        return cls(total(observed.astype(float)), total(clean), total(clean * clean))

    def __add__(self, other: Statistics) -> Statistics:
        return Statistics(
            self.counts + other.counts,
            self.sums + other.sums,
            self.sums_of_squares + other.sums_of_squares,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.counts.shape


@dataclass(frozen=True)
class Estimate:
    """An estimate of mu.

    Attributes
    ----------
    means : ndarray, shape (..., M, K)
        Estimated means; arms without data get the documented fallback.
    standard_errors : ndarray, shape (..., M, K)
        Standard errors of ``means``; nan where undefined.
    """

    means: np.ndarray
    standard_errors: np.ndarray


def fill_missing(means: np.ndarray, has_data: np.ndarray) -> np.ndarray:
    """Replace entries without data by the mean of the metric's entries with data (0 if none).

    Parameters
    ----------
    means : ndarray, shape (..., M, K)
    has_data : ndarray of bool, shape (..., M, K)
    """
    with_data = has_data.sum(axis=-1, keepdims=True)
    total = np.where(has_data, means, 0.0).sum(axis=-1, keepdims=True)
    fallback = np.divide(total, with_data, out=np.zeros_like(total), where=with_data > 0)
    return np.where(has_data, means, fallback)


def pooled_estimate(statistics: Statistics) -> Estimate:
    """Per-arm sample means over all observations, with standard errors.

    Parameters
    ----------
    statistics : Statistics
        Pooled (or discounted) statistics, shape (..., M, K).

    Returns
    -------
    Estimate
        Means sum / count (fallback for arms without data, see module doc); standard errors
        sqrt(s^2 / n) with the unbiased sample variance s^2, nan where count < 2.
    """
    n = statistics.counts
    has_data = n > 0
    raw = np.divide(statistics.sums, n, out=np.zeros_like(statistics.sums), where=has_data)
    means = fill_missing(raw, has_data)
    several = n > 1
    centred = statistics.sums_of_squares - n * raw**2
    variance = np.divide(
        np.maximum(centred, 0.0), n - 1.0, out=np.full_like(centred, np.nan), where=several
    )
    standard_errors = np.sqrt(np.divide(variance, n, out=np.full_like(variance, np.nan), where=several))
    return Estimate(means=means, standard_errors=standard_errors)


def _round_sizes(round_statistics: Statistics) -> np.ndarray:
    """(..., M, 1) observations of each metric in the round (the paper's Q)."""
    return round_statistics.counts.sum(axis=-1, keepdims=True)


def ips_round_estimate(round_statistics: Statistics, propensities: np.ndarray) -> np.ndarray:
    """The paper's per-round inverse-propensity estimate U_t (Eq. 5, averaged over Q queries).

    Parameters
    ----------
    round_statistics : Statistics
        Observations of one round, shape (..., M, K).
    propensities : ndarray, shape (..., K)
        Probabilities served when the round was sampled; must be > 0 where counts > 0.

    Returns
    -------
    ndarray, shape (..., M, K)
        ``sums[m, k] / (n[m] p_k)``; rows of metrics without any observation are 0 (callers skip
        them, see :func:`history_update`).
    """
    p = np.asarray(propensities, dtype=float)[..., None, :]
    n = _round_sizes(round_statistics)
    denominator = n * p
    return np.divide(
        round_statistics.sums,
        denominator,
        out=np.zeros_like(round_statistics.sums),
        where=denominator > 0,
    )


def control_variate_round_estimate(
    round_statistics: Statistics, propensities: np.ndarray, baseline: np.ndarray
) -> np.ndarray:
    """Control-variate per-round estimate ``B + (sums - counts B) / (n p)``.

    Parameters
    ----------
    round_statistics : Statistics
        Observations of one round, shape (..., M, K).
    propensities : ndarray, shape (..., K)
        Probabilities served when the round was sampled.
    baseline : ndarray, shape (..., M, K)
        Baseline B, fixed before the round was sampled (otherwise the estimate is biased).

    Returns
    -------
    ndarray, shape (..., M, K)
        Unbiased for mu whenever every arm has p_k > 0.
    """
    baseline = np.asarray(baseline, dtype=float)
    p = np.asarray(propensities, dtype=float)[..., None, :]
    n = _round_sizes(round_statistics)
    residual = round_statistics.sums - round_statistics.counts * baseline
    denominator = n * p
    correction = np.divide(residual, denominator, out=np.zeros_like(residual), where=denominator > 0)
    return baseline + correction


@dataclass(frozen=True)
class History:
    """Discounted running sums of per-round estimates U_t.

    Attributes
    ----------
    sums : ndarray, shape (..., M, K)
        sum_s delta^(t-s) U_s.
    sums_of_squares : ndarray, shape (..., M, K)
        sum_s delta^(t-s) U_s^2.
    weights : ndarray, shape (..., M)
        sum_s delta^(t-s) over the rounds that observed the metric (+ delta^t for the paper's U_0).
    """

    sums: np.ndarray
    sums_of_squares: np.ndarray
    weights: np.ndarray


def empty_history(
    n_metrics: int, n_arms: int, batch_shape: tuple[int, ...] = (), prior_weight: float = 0.0
) -> History:
    """A history with no rounds; ``prior_weight`` = 1 counts the paper's U_0 = 0 (Algorithm 1)."""
    shape = tuple(batch_shape) + (n_metrics, n_arms)
    return History(
        sums=np.zeros(shape),
        sums_of_squares=np.zeros(shape),
        weights=np.full(tuple(batch_shape) + (n_metrics,), float(prior_weight)),
    )


def history_update(
    history: History, round_estimate: np.ndarray, observed: np.ndarray, discount: float = 1.0
) -> History:
    """Add one round's U_t to the history.

    Parameters
    ----------
    history : History
    round_estimate : ndarray, shape (..., M, K)
        U_t.
    observed : ndarray of bool, shape (..., M)
        Which metrics had observations this round; the others are not counted as a round.
    discount : float
        delta in (0, 1].
    """
    mask = np.asarray(observed, dtype=bool)
    u = np.where(mask[..., None], round_estimate, 0.0)
    return History(
        sums=discount * history.sums + u,
        sums_of_squares=discount * history.sums_of_squares + u**2,
        weights=discount * history.weights + mask,
    )


def history_estimate(history: History) -> Estimate:
    """V = S / W with standard errors from the spread of the U_t (see module doc)."""
    w = history.weights[..., None]
    has_rounds = np.broadcast_to(w > 0, history.sums.shape)
    means = np.divide(history.sums, w, out=np.zeros_like(history.sums), where=has_rounds)
    means = fill_missing(means, has_rounds)
    several = np.broadcast_to(w > 1, history.sums.shape)
    spread = np.maximum(history.sums_of_squares - w * means**2, 0.0)
    variance = np.divide(spread, w - 1.0, out=np.full_like(spread, np.nan), where=several)
    standard_errors = np.sqrt(np.divide(variance, w, out=np.full_like(variance, np.nan), where=several))
    return Estimate(means=means, standard_errors=standard_errors)


def discount_statistics(
    accumulated: Statistics, round_statistics: Statistics, discount: float
) -> Statistics:
    """Exponentially discounted pooled statistics: ``delta * accumulated + round``."""
    return Statistics(
        discount * accumulated.counts + round_statistics.counts,
        discount * accumulated.sums + round_statistics.sums,
        discount * accumulated.sums_of_squares + round_statistics.sums_of_squares,
    )


# ---------------------------------------------------------------------------- estimator objects
@dataclass(frozen=True)
class Accumulators:
    """What an estimator carries from one round to the next (each field only where it is used).

    Attributes
    ----------
    history : History or None
        Running sums of the per-round estimates U_t (``ips``, ``control_variate``).
    baseline : ndarray, shape (..., M, K), or None
        Control-variate baseline B for the round being served (``control_variate``).
    discounted : Statistics or None
        Discounted pooled statistics (``pooled`` with discount < 1).
    """

    history: History | None = None
    baseline: np.ndarray | None = None
    discounted: Statistics | None = None


class Estimator(Protocol):
    """The operations the controller's update needs from an estimator (see module doc)."""

    name: str
    discount: float

    def start(self, n_metrics: int, n_arms: int, batch_shape: tuple[int, ...] = ()) -> Accumulators:
        """The accumulators before round 1, arrays with leading ``batch_shape``."""
        ...

    def absorb(
        self,
        accumulators: Accumulators,
        round_statistics: Statistics,
        pooled_statistics: Statistics,
        propensities: np.ndarray,
    ) -> Accumulators:
        """The accumulators after one closed round (statistics (..., M, K), propensities (..., K))."""
        ...

    def estimate(self, accumulators: Accumulators, pooled_statistics: Statistics) -> Estimate:
        """The current estimate of the M x K means."""
        ...


def _history_of(accumulators: Accumulators, name: str) -> History:
    if accumulators.history is None:
        raise ValueError(f"The state carries no history, which the {name!r} estimator needs.")
    return accumulators.history


def _observed_metrics(round_statistics: Statistics) -> np.ndarray:
    """(..., M) whether each metric has an observation in the round (others are not a round)."""
    return round_statistics.counts.sum(axis=-1) > 0


@dataclass(frozen=True)
class IpsEstimator:
    """The paper's history average of inverse-propensity estimates, U_0 = 0 counted as a round.

    Attributes
    ----------
    discount : float
        delta in (0, 1] applied to the history each round.
    """

    discount: float = 1.0
    name: ClassVar[str] = "ips"

    def start(self, n_metrics: int, n_arms: int, batch_shape: tuple[int, ...] = ()) -> Accumulators:
        # The paper's V_0 = U_0 = 0 enters the average as one round (Algorithm 1 line 5).
        return Accumulators(history=empty_history(n_metrics, n_arms, batch_shape, prior_weight=1.0))

    def absorb(
        self,
        accumulators: Accumulators,
        round_statistics: Statistics,
        pooled_statistics: Statistics,
        propensities: np.ndarray,
    ) -> Accumulators:
        u = ips_round_estimate(round_statistics, propensities)
        history = history_update(
            _history_of(accumulators, self.name), u, _observed_metrics(round_statistics), self.discount
        )
        return Accumulators(history=history, baseline=accumulators.baseline, discounted=accumulators.discounted)

    def estimate(self, accumulators: Accumulators, pooled_statistics: Statistics) -> Estimate:
        return history_estimate(_history_of(accumulators, self.name))


@dataclass(frozen=True)
class ControlVariateEstimator:
    """History average of control-variate estimates, the baseline being the previous pooled means.

    Attributes
    ----------
    discount : float
        delta in (0, 1] applied to the history each round.
    """

    discount: float = 1.0
    name: ClassVar[str] = "control_variate"

    def start(self, n_metrics: int, n_arms: int, batch_shape: tuple[int, ...] = ()) -> Accumulators:
        return Accumulators(
            history=empty_history(n_metrics, n_arms, batch_shape, prior_weight=0.0),
            baseline=np.zeros(tuple(batch_shape) + (n_metrics, n_arms)),
        )

    def absorb(
        self,
        accumulators: Accumulators,
        round_statistics: Statistics,
        pooled_statistics: Statistics,
        propensities: np.ndarray,
    ) -> Accumulators:
        u = control_variate_round_estimate(round_statistics, propensities, accumulators.baseline)
        history = history_update(
            _history_of(accumulators, self.name), u, _observed_metrics(round_statistics), self.discount
        )
        # The next round's baseline is fixed now, before it is sampled, which keeps U unbiased.
        baseline = pooled_estimate(pooled_statistics).means
        return Accumulators(history=history, baseline=baseline, discounted=accumulators.discounted)

    def estimate(self, accumulators: Accumulators, pooled_statistics: Statistics) -> Estimate:
        return history_estimate(_history_of(accumulators, self.name))


@dataclass(frozen=True)
class PooledEstimator:
    """Per-arm sample means over every observation, or over discounted statistics when discount < 1.

    Attributes
    ----------
    discount : float
        delta in (0, 1]; below 1 the estimator keeps its own discounted statistics.
    """

    discount: float = 1.0
    name: ClassVar[str] = "pooled"

    def start(self, n_metrics: int, n_arms: int, batch_shape: tuple[int, ...] = ()) -> Accumulators:
        if self.discount < 1.0:
            return Accumulators(discounted=Statistics.zeros(n_metrics, n_arms, batch_shape))
        return Accumulators()

    def absorb(
        self,
        accumulators: Accumulators,
        round_statistics: Statistics,
        pooled_statistics: Statistics,
        propensities: np.ndarray,
    ) -> Accumulators:
        if self.discount == 1.0:
            return accumulators
        discounted = discount_statistics(accumulators.discounted, round_statistics, self.discount)
        return Accumulators(history=accumulators.history, baseline=accumulators.baseline, discounted=discounted)

    def estimate(self, accumulators: Accumulators, pooled_statistics: Statistics) -> Estimate:
        if self.discount == 1.0:
            return pooled_estimate(pooled_statistics)
        if accumulators.discounted is None:
            raise ValueError("The state carries no discounted statistics, which a discount < 1 needs.")
        return pooled_estimate(accumulators.discounted)


_ESTIMATOR_TYPES = {"ips": IpsEstimator, "control_variate": ControlVariateEstimator, "pooled": PooledEstimator}
ESTIMATOR_NAMES: tuple[str, ...] = ("ips", "pooled", "control_variate")


def make_estimator(name: str, discount: float = 1.0) -> Estimator:
    """The estimator object called ``name`` (one of :data:`ESTIMATOR_NAMES`) with discount delta."""
    if name not in _ESTIMATOR_TYPES:
        raise ValueError(f"Unknown estimator {name!r}; the estimators are {list(ESTIMATOR_NAMES)}.")
    if not 0.0 < discount <= 1.0:
        raise ValueError(f"The discount must be in (0, 1], got {discount}.")
    return _ESTIMATOR_TYPES[name](discount=float(discount))
