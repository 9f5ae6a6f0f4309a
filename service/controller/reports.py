"""Reports: round summaries, round history, diagnostics, the controller state behind ``/metrics``, health.

Round summaries (stored at each update) and diagnostics (computed on request) both come from ONE core
function, ``pasto.report.round_report``: estimate -> objective of the served and deployed mixtures,
best mixture, best single arm, regret, guardrails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from pasto.algorithm import AlgorithmConfig, ControllerState, EstimationConfig
from pasto.diagnostics import sample_ratio_mismatch
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.report import Optimum, RoundReport, round_report, solve_optimum
from pasto.segments import SegmentedConfig, SegmentedState, measured_shares, pool_segments, segment_report

from .. import store
from ..cache import Snapshot
from ..db import DATABASE_ERRORS, is_unavailable_error
from ..errors import ApiError
from ..models import utcnow
from ..responses import RoundSummary, StoredBestSingle, StoredLift, StoredSegments
from ..store import UnitOfWork
from .experiments import algorithm_and_objective, expected_shares, load_segment_state, segmented_config


def round_summary(algorithm: AlgorithmConfig, objective: Objective, state: ControllerState,
                  pooled: Statistics, propensities: np.ndarray, segments: StoredSegments | None = None
                  ) -> RoundSummary:
    """Estimated quality of a round's mixture, on the estimate available right after its update
    (stored with the round): ``pasto.report.round_report`` with the propensities round t was served;
    ``segments``: a segmented experiment's :func:`segment_summary`."""
    report = round_report(algorithm, objective, state, pooled, served=propensities)
    return RoundSummary(
        objective=finite(report.served.value),
        objective_deployed=finite(report.deployed.value),
        best_mixture=finite(report.best_mixture_value),
        best_single=None if report.best_single_arm is None else StoredBestSingle(
            arm_index=report.best_single_arm, value=finite(report.best_single_value)),
        regret=finite(report.served.regret),
        # "guardrails": the traffic served in the round (what users got); "guardrails_deployed": the
        # mixture recommended after its update (rows stored before this key have only the first).
        guardrails=json_safe(list(report.served.guardrails)),
        guardrails_deployed=json_safe(list(report.deployed.guardrails)),
        lift=lift_summary(report),
        **({} if segments is None else {"segments": segments}),
    )


def segment_observations(statistics: Statistics) -> np.ndarray:
    """Observations per segment (S,) of statistics (S, M, K): per segment, the count of its most observed
    metric summed over arms (an observation may carry several metrics)."""
    return statistics.counts.sum(axis=-1).max(axis=-1)


def segment_summary(config: SegmentedConfig, objective: Objective, state: SegmentedState, pooled: Statistics,
                    shares: np.ndarray, names: list[str] | None = None) -> StoredSegments:
    """The per-segment part of a round summary or of the diagnostics (``pasto.segments.segment_report``
    of the deployed per-segment mixtures): per segment its share, served and deployed mixture, objective
    and guardrails; the platform-wide guardrails; the gain of segmenting over one global mixture.

    Built as the JSON it is stored as (every key, in this order), then typed: ``to_json()`` gives
    that JSON back key for key."""
    report = segment_report(config, objective, state.deployed, pooled, shares)
    observations = segment_observations(pooled)
    return StoredSegments.model_validate(json_safe({
        "segments": [
            {"name": None if names is None else names[s], "share": report.shares[s],
             "observations": int(observations[s]),
             "probabilities": state.probabilities[s], "deployed": state.deployed[s],
             "objective": report.segment_values[s], "guardrails": list(report.guardrails[s])}
            for s in range(state.n_segments)
        ],
        "objective": report.platform_value,
        "platform_guardrails": list(report.platform_guardrails),
        "global_mixture": {"probabilities": report.global_mixture, "objective": report.global_value},
        "gain": {"value": report.gain, "interval": report.gain_interval},
    }))


def lift_summary(report: RoundReport) -> StoredLift | None:
    """The served and deployed mixtures' lifts over the baseline arm as JSON (``baseline_index``, then per
    mixture ``primary`` and ``objective``: ``estimate``, ``interval``, ``relative``,
    ``relative_interval``), or None when the objective has no baseline arm."""
    if report.baseline_arm is None:
        return None

    def lifts(mixture) -> dict[str, Any]:
        return {measure: json_safe({"estimate": lift.estimate, "interval": [lift.lower, lift.upper],
                                    "relative": lift.relative,
                                    "relative_interval": [lift.relative_lower, lift.relative_upper]})
                for measure, lift in mixture.lift.items()}

    return StoredLift(baseline_index=report.baseline_arm, served=lifts(report.served), deployed=lifts(report.deployed))


def finite(value: float) -> float | None:
    """``value`` as a float, or None when it is not finite (JSON has no NaN or infinity)."""
    value = float(value)
    return value if np.isfinite(value) else None


def json_safe(value: Any) -> Any:
    """Nested dicts/lists/arrays of numpy scalars -> plain JSON values, non-finite floats -> None."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_safe(item) for item in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return finite(value)
    return value


# ------------------------------------------------------------------------------ summarised per-arm arrays
@dataclass(frozen=True)
class ArmSelection:
    """The arms a summarised read keeps (``?arms=N``) and the rest it sums.

    Attributes
    ----------
    kept : ndarray of int, shape (N,)
        Positions of the N arms of largest weight, largest first, ties by position.
    rest : ndarray of int, shape (K - N,)
        Positions of the other arms, ascending.
    """

    kept: np.ndarray
    rest: np.ndarray

    def keep(self, values) -> list:
        """``values`` (K,) at the kept arms, as a list in their order."""
        return np.asarray(values)[self.kept].tolist()

    def rest_sum(self, values) -> float:
        """The sum of ``values`` (K,) over the rest (nan propagates)."""
        return float(np.asarray(values, dtype=np.float64)[self.rest].sum())

    def rest_weighted(self, weights, values) -> float:
        """``sum over the rest of weights[k] * values[k]`` over the arms of positive weight (both (K,));
        nan when one of those has no value (an arm of zero weight adds nothing, known or not)."""
        weights = np.asarray(weights, dtype=np.float64)[self.rest]
        values = np.asarray(values, dtype=np.float64)[self.rest]
        used = weights > 0
        return float(np.sum(weights[used] * values[used]))


def select_arms(probabilities: np.ndarray, deployed: np.ndarray, count: int | None) -> ArmSelection | None:
    """The :class:`ArmSelection` of the ``count`` arms of largest weight ``max(probabilities, deployed)``
    (both (K,): p_t and the deployed mixture), or None (the response keeps every arm in order) when
    ``count`` is None or at least K.

    By the larger of the two, so that the arms a reader ranks by either (the dashboard's stacked p_t
    and its deployed bars) are kept: an arm can be served much (exploration, or p_t moving ahead of
    the deployed average) while its deployed weight is still small, and the other way round."""
    weight = np.maximum(np.asarray(probabilities, dtype=np.float64), np.asarray(deployed, dtype=np.float64))
    if count is None or count >= weight.shape[0]:
        return None
    order = np.argsort(-weight, kind="stable")  # stable: equal weights stay in arm order
    return ArmSelection(kept=order[:count], rest=np.sort(order[count:]))


def segments_kept(segments: StoredSegments | None, selection: ArmSelection | None) -> dict[str, Any] | None:
    """The JSON of a segment report (:func:`segment_summary`: the diagnostics' or a stored round
    summary's) as the API sends it, with its per-arm arrays (each segment's probabilities and deployed,
    the global mixture's probabilities, all (K,)) cut to the arms ``selection`` keeps (every arm when
    ``selection`` is None); None when ``segments`` is None."""
    if segments is None:
        return None
    if selection is not None:
        segments = segments.model_copy(update={
            "segments": [segment.model_copy(update={"probabilities": selection.keep(segment.probabilities),
                                                    "deployed": selection.keep(segment.deployed)})
                         for segment in segments.segments],
            "global_mixture": segments.global_mixture.model_copy(
                update={"probabilities": selection.keep(segments.global_mixture.probabilities)})})
    return segments.to_json()


# ------------------------------------------------------------------------------ diagnostics
@dataclass(frozen=True)
class Diagnostics:
    snapshot: Snapshot
    report: RoundReport  # served: the current round's p_t; deployed: the recommended mixture
    regret_per_round: list[float | None]
    units: np.ndarray  # (K,)
    late_observations: int
    srm: dict[str, Any]
    #: (M, K): whether each arm has an observation of each metric (pooled counts > 0); where not, the
    #: estimate's mean is a stand-in (the other arms' average, :func:`pasto.estimators.fill_missing`).
    observed: np.ndarray
    source_error: dict[str, Any] | None = None  # see source_error_view
    segments: StoredSegments | None = None  # segmented experiments: segment_summary on the current data


def diagnostics(uow: UnitOfWork, name: str) -> Diagnostics:
    """How experiment ``name`` is doing on the current estimate."""
    snapshot = uow.cache.get(name)
    n_arms, n_metrics = snapshot.n_arms, len(snapshot.metrics)
    with uow.read() as session:
        algorithm, objective = algorithm_and_objective(uow, session, snapshot.id, snapshot.config)
        segmented = segmented_config(snapshot.config, algorithm)
        if segmented is not None:
            # The stored state, read in this transaction (an open set may have grown since the snapshot);
            # the statistics below are of the same snapshot, so they have no segment the state has not.
            stored = store.segment_state(session, snapshot.id)
            if stored is None:  # a segmented experiment always has one: deleted since the snapshot
                raise ApiError(404, "not_found", f"There is no experiment named {name!r}: it was deleted while "
                                                 "its diagnostics were being read.")
            loaded, names = load_segment_state(stored)
        # (S, M, K), one segment for an unsegmented experiment; the experiment's totals are their sums.
        segment_pooled = store.pooled_statistics(session, snapshot.id, snapshot.round_index,
                                                 1 if segmented is None else loaded.n_segments, n_metrics, n_arms)
        forget_gone_experiments(uow, session, snapshot.id)
        regret_per_round = stored_regrets(uow, session, snapshot.id, snapshot.name)
        units, late, srm = running_traffic(uow, session, snapshot.id, n_arms,
                                           (snapshot.round_index, snapshot.probabilities))
        source_error = source_error_view(store.source_error(session, snapshot.id))
    pooled = pool_segments(segment_pooled)
    state = ControllerState.from_dict(snapshot.state)
    segments = None
    if segmented is not None:
        # The aggregate reads pooled statistics: the per-segment estimator accumulators have no aggregate.
        algorithm = dataclasses.replace(algorithm, estimation=EstimationConfig())
        shares = measured_shares(segment_observations(segment_pooled), expected_shares(snapshot.config,
                                                                                        loaded.n_segments))
        segments = segment_summary(segmented, objective, loaded, segment_pooled, shares, names)
    report = round_report(algorithm, objective, state, pooled, served=snapshot.probabilities,
                          solve=cached_solver(uow, snapshot.id, snapshot.version))
    return Diagnostics(snapshot=snapshot, report=report,
                       regret_per_round=regret_per_round,
                       units=units, late_observations=late, srm=srm, observed=pooled.counts > 0,
                       source_error=source_error,
                       segments=segments)


class _RegretCache:
    """Per process and database: each experiment's ``{round_index: regret}`` of the summaries read so far."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, dict[int, Any]] = {}


_regret_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> _RegretCache

#: Above this many rounds not yet cached, every summary is read in one query instead of an IN list.
_REGRET_IN_LIST = 100


def stored_regrets(uow: UnitOfWork, session, experiment_id: int, name: str) -> list[Any]:
    """The regret of every summarised round of experiment ``experiment_id`` (named ``name``), in round
    order (None: a summary without one), as the round summaries hold it.

    A summary is written once, after its round's update, and never changed (``store.store_summaries``
    writes only where there is none; late data goes into the next update, not into a closed round's
    summary), and experiment ids are never reused. So this process keeps the regrets it has read and
    reads the indexes of the summarised rounds, and the summaries only of those it has not seen: a
    poll after 1,000 rounds reads 1,000 integers, not 1,000 summaries.

    Both reads run in the caller's read transaction, one snapshot (``service.db``): a delete committed
    between them is not seen.

    Raises
    ------
    ApiError
        404 when a summary listed by the first read is gone by the second (only deleting the
        experiment removes a summary): a guard, which a read outside one snapshot would need.
    """
    with _cache_lock:
        cache = _regret_caches.setdefault(uow.database.engine, _RegretCache())
    indexes = store.summarized_rounds(session, experiment_id)
    with cache.lock:
        known = dict(cache.entries.setdefault(experiment_id, {}))
    missing = [index for index in indexes if index not in known]
    if missing:
        known.update(store.round_regrets(session, experiment_id,
                                         missing if len(missing) <= _REGRET_IN_LIST else None))
        if any(index not in known for index in missing):
            with cache.lock:
                cache.entries.pop(experiment_id, None)
            raise ApiError(404, "not_found", f"There is no experiment named {name!r}: it was deleted while "
                                             "its diagnostics were being read.")
        with cache.lock:
            cache.entries.setdefault(experiment_id, {}).update(known)
    return [known[index] for index in indexes]


def forget_gone_experiments(uow: UnitOfWork, session, experiment_id: int) -> None:
    """Drop this process's cached regrets and optimum of deleted experiments (ids are never reused, so
    theirs would be kept for nothing), as :func:`controller_metrics` does for its own cache.

    Checked when ``experiment_id`` is not yet in one of the two caches, i.e. before either grows: the
    caches then hold at most the experiments that exist and the one being added, and a poll of a cached
    experiment reads nothing more."""
    with _cache_lock:
        regrets = _regret_caches.setdefault(uow.database.engine, _RegretCache())
        optima = _optimum_caches.setdefault(uow.database.engine, _OptimumCache())
    with regrets.lock, optima.lock:
        if experiment_id in regrets.entries and experiment_id in optima.entries:
            return
        others = (set(regrets.entries) | set(optima.entries)) - {experiment_id}
    gone = others - store.existing_experiment_ids(session, sorted(others))
    for cache in (regrets, optima):
        with cache.lock:
            for identifier in gone:
                cache.entries.pop(identifier, None)


class _OptimumCache:
    """Per process and database: each experiment's latest :class:`pasto.report.Optimum` and its key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, tuple[tuple, Optimum]] = {}


_optimum_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> _OptimumCache


def cached_solver(uow: UnitOfWork, experiment_id: int, version: int):
    """A ``solve`` for :func:`pasto.report.round_report` that reuses this process's last optimum of the
    experiment when its inputs are the same.

    The key is the experiment's version (configuration, state, round) and a digest of the exact inputs
    (the objective, the M x K means and the G thresholds): ingestion changes the estimate without a new
    version, and then the optimum is solved again. A poll between rounds with no new data (the
    dashboard's, every few seconds) reuses it: the best mixture is a linear program over K arms.

    So it helps an idle experiment only: the default pooled estimator includes the open round's
    statistics, so while traffic flows every ingested batch changes the means and the next poll in
    each worker solves again. Measured (docs/benchmarks.md, "Diagnostics while traffic flows"): about
    20 ms more per diagnostics request at K = 10,000, a poll near 70 ms against the 200 ms target, so
    the optimum is never served older than the estimate beside it.
    """
    with _cache_lock:
        cache = _optimum_caches.setdefault(uow.database.engine, _OptimumCache())

    def solve(objective: Objective, means: np.ndarray, thresholds: np.ndarray) -> Optimum:
        digest = hashlib.sha256()
        digest.update(repr(objective.to_spec()).encode())
        for array in (means, thresholds):
            array = np.ascontiguousarray(array, dtype=np.float64)
            digest.update(repr(array.shape).encode())
            digest.update(array.tobytes())
        key = (version, digest.digest())
        with cache.lock:
            entry = cache.entries.get(experiment_id)
        # An entry without shadow prices (made by a solve that did not keep them) is solved again.
        if entry is not None and entry[0] == key and entry[1].shadow_prices is not None:
            return entry[1]
        fresh = solve_optimum(objective, means, thresholds)
        for array in (fresh.best_mixture, fresh.shadow_prices):
            if array is not None:
                array.flags.writeable = False  # shared by the requests that reuse it
        with cache.lock:
            cache.entries[experiment_id] = (key, fresh)
        return fresh

    return solve


def traffic_report(uow: UnitOfWork, session, experiment_id: int, n_arms: int) -> tuple[np.ndarray, int, dict]:
    """Observed units per arm (K,), late observations, and the sample-ratio-mismatch test against the
    split expected from each round's logged probabilities, computed from every round's rows: the
    definition :func:`running_traffic` (what diagnostics and ``/metrics`` use) keeps up to date
    without reading every round again."""
    counts, round_probabilities = store.traffic_rows(session, experiment_id)
    units = np.zeros(n_arms)
    expected = np.zeros(n_arms)
    late = 0
    units_by_round: dict[int, np.ndarray] = {}
    for row in counts:
        units_by_round.setdefault(row.round_index, np.zeros(n_arms))[row.arm_index] += row.units
        late += row.late_observations
    for row in round_probabilities:
        round_units = units_by_round.get(row.index)
        if round_units is not None:
            units += round_units
            expected += round_units.sum() * np.asarray(row.probabilities, dtype=np.float64)
    if units.sum() > 0:
        srm = json_safe(sample_ratio_mismatch(units, expected / expected.sum()))
    else:
        srm = {"statistic": None, "p_value": None, "ok": True}
    return units, late, srm


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


def source_error_view(row) -> dict[str, Any] | None:
    """The failing metric source of an experiment as the API shows it (None: no source, or its latest
    attempt succeeded): ``message`` (the source's sentence), ``since`` (first failure of this run),
    ``last_failed_at`` and ``failures`` (every failed attempt of the experiment)."""
    if row is None or row.error is None:
        return None
    return {"message": row.error, "since": _iso(row.error_since), "last_failed_at": _iso(row.last_error_at),
            "failures": int(row.errors_total)}


# ------------------------------------------------------------------------------ round history
@dataclass(frozen=True)
class RoundHistory:
    snapshot: Snapshot
    rounds: list  # service.models.Round rows, oldest first
    counts: np.ndarray  # (rounds, K) observations
    units: np.ndarray  # (rounds, K) distinct units
    late: np.ndarray  # (rounds,)
    means: np.ndarray  # (rounds, M, K), nan where no data
    source_error: dict[str, Any] | None = None  # see source_error_view
    segment_observations: np.ndarray | None = None  # segmented: (rounds, S) observations per segment


def arm_count(uow: UnitOfWork, name: str) -> int:
    """K of experiment ``name`` (404 when there is none), from the cached snapshot."""
    return uow.cache.get(name).n_arms


def round_history(uow: UnitOfWork, name: str, since: int, limit: int | None) -> RoundHistory:
    """Rounds ``since`` .. ``since + limit - 1`` (at most up to the current one) of experiment ``name``."""
    snapshot = uow.cache.get(name)
    last = snapshot.round_index if limit is None else min(snapshot.round_index, since + limit - 1)
    with uow.read() as session:
        round_rows, statistics, counts = store.round_history(session, snapshot.id, since, last,
                                                             segmented=snapshot.segmented)
        source_error = source_error_view(store.source_error(session, snapshot.id))
        traffic = store.segment_round_traffic(session, snapshot.id, since, last) if snapshot.segmented else None
    n_rounds, n_arms, n_metrics = max(0, last - since + 1), snapshot.n_arms, len(snapshot.metrics)
    metric_counts = np.zeros((n_rounds, n_metrics, n_arms))
    metric_sums = np.zeros((n_rounds, n_metrics, n_arms))
    if len(statistics):
        offset, metric, arm = (statistics[:, column].astype(np.int64) for column in range(3))
        offset -= since
        metric_counts[offset, metric, arm] = statistics[:, 3]
        metric_sums[offset, metric, arm] = statistics[:, 4]
    observation_counts = np.zeros((n_rounds, n_arms), dtype=np.int64)
    unit_counts = np.zeros((n_rounds, n_arms), dtype=np.int64)
    late_counts = np.zeros(n_rounds, dtype=np.int64)
    if len(counts):
        offset, arm = counts[:, 0] - since, counts[:, 1]
        observation_counts[offset, arm] = counts[:, 2]
        unit_counts[offset, arm] = counts[:, 3]
        np.add.at(late_counts, offset, counts[:, 4])
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(metric_counts > 0, metric_sums / metric_counts, np.nan)
    segment_counts = None
    if traffic is not None:
        # Per round and segment, the count of its most observed metric (an observation may carry several).
        n_segments = max([len(snapshot.segment_names)] + [segment + 1 for _, segment, _, _ in traffic])
        per_metric = np.zeros((n_rounds, n_segments, n_metrics), dtype=np.int64)
        for round_index, segment, metric, count in traffic:
            per_metric[round_index - since, segment, metric] = count
        segment_counts = per_metric.max(axis=-1, initial=0)
    return RoundHistory(snapshot=snapshot, rounds=list(round_rows), counts=observation_counts, units=unit_counts,
                        late=late_counts, means=means, source_error=source_error,
                        segment_observations=segment_counts)


# ------------------------------------------------------------------------------ monitoring, health
@dataclass(frozen=True)
class MonitoredExperiment:
    """The row of one experiment a scrape reports (the attributes ``service.monitoring`` reads)."""

    id: int
    name: str
    status: str
    round_index: int
    applied_rounds: int
    updated_at: datetime
    config: dict[str, Any]
    state: dict[str, Any]


@dataclass(frozen=True)
class _VersionedMetrics:
    """What a scrape reports of one experiment that changes only with its version and latest summary."""

    key: tuple[int, bool]  # (version, latest applied round summarized)
    config: dict[str, Any]
    state: dict[str, Any]
    rounds: list[Any]
    regret_sum: float | None
    arm_names: list[str]


class _Traffic:
    """Units per arm, the split they were expected in and the sample-ratio test, kept between scrapes.

    The expected split is ``sum over rounds r of n_r * p_r`` (``n_r`` units observed in round ``r``,
    ``p_r`` its propensities, K floats each): summed from scratch it reads every round's
    propensities, 80 MB of JSON after 1,000 rounds at K = 10,000. Kept as a running sum, a scrape
    reads ``p_r`` only for rounds whose ``n_r`` changed since the last one (usually the current round,
    whose propensities the versioned part holds already). Counts only grow, so when no round's
    ``n_r`` changed neither did the units per arm: the test is not run again.
    """

    def __init__(self, n_arms: int) -> None:
        self.round_units: dict[int, float] = {}
        self.expected = np.zeros(n_arms)
        self.units = np.zeros(n_arms)
        self.srm: dict[str, Any] = {"statistic": None, "p_value": None, "ok": True}

    def update(self, uow: UnitOfWork, session, experiment_id: int, round_units: dict[int, float],
               current: tuple[int, Any] | None) -> None:
        changes = {round_index: units - self.round_units.get(round_index, 0.0)
                   for round_index, units in round_units.items() if units != self.round_units.get(round_index, 0.0)}
        propensities: dict[int, np.ndarray] = {}
        if current is not None and current[0] in changes:
            propensities[current[0]] = np.asarray(current[1], dtype=np.float64)
        wanted = [round_index for round_index in changes if round_index not in propensities]
        for round_index, text in store.round_probabilities_text(session, experiment_id, wanted):
            propensities[round_index] = np.fromstring(text.strip()[1:-1], sep=",")
        changed = False
        for round_index, change in changes.items():
            probabilities = propensities.get(round_index)
            if probabilities is None or probabilities.shape != self.expected.shape:
                continue
            self.expected += change * probabilities
            self.round_units[round_index] = round_units[round_index]
            changed = True
        if not changed:
            return
        units = np.zeros(len(self.expected))
        for arm_index, arm_units in store.arm_units(session, experiment_id):
            units[arm_index] = arm_units or 0
        self.units = units
        if units.sum() > 0:
            self.srm = json_safe(sample_ratio_mismatch(units, self.expected / self.expected.sum()))


class _ScrapeCache:
    """Per process and database: the versioned part and the traffic sums of each experiment."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.versioned: dict[int, _VersionedMetrics] = {}
        self.traffic: dict[int, _Traffic] = {}


_scrape_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> _ScrapeCache


def _scrape_cache(uow: UnitOfWork) -> _ScrapeCache:
    with _cache_lock:
        return _scrape_caches.setdefault(uow.database.engine, _ScrapeCache())


def running_traffic(uow: UnitOfWork, session, experiment_id: int, n_arms: int,
                    current: tuple[int, Any] | None) -> tuple[np.ndarray, int, dict[str, Any]]:
    """:func:`traffic_report` of one experiment from this process's running sums (:class:`_Traffic`):
    it reads the per-round count totals and only the propensities of rounds whose units changed, not
    every round's (38 s of a diagnostics request after 1,000 rounds at K = 10,000). ``current``:
    ``(index, propensities)`` of the current round, which the caller has at hand."""
    cache = _scrape_cache(uow)
    round_units: dict[int, float] = {}
    late = 0
    for _, round_index, units, _, round_late in store.round_totals(session, [experiment_id]):
        round_units[round_index] = float(units or 0)
        late += int(round_late or 0)
    with cache.lock:
        running = cache.traffic.get(experiment_id)
        if running is None or running.expected.shape != (n_arms,):
            running = cache.traffic[experiment_id] = _Traffic(n_arms)
        running.update(uow, session, experiment_id, round_units, current)
        return running.units.copy(), late, running.srm


def controller_metrics(uow: UnitOfWork) -> dict[str, Any]:
    """What a ``/metrics`` scrape reports about every experiment not archived: ``experiments``
    (:class:`MonitoredExperiment`), ``rounds`` (the open ones and the latest applied), ``regret_sums``,
    ``stored`` (observations), ``arm_names`` and ``traffic``: ``(units per arm, late observations,
    srm)`` as :func:`traffic_report` computes them.

    A scrape reads one small row per experiment and the count totals; state, configuration, rounds,
    arm names and the regret sum are read again only when the experiment's version changed or its
    latest summary arrived (cached per process), so a scrape at K = 10,000 does not parse the
    controller state and K names every time (docs/benchmarks.md, ``bench/metrics_scrape.py``).
    """
    cache = _scrape_cache(uow)
    with cache.lock, uow.read() as session:
        rows = store.monitoring_versions(session)
        keys = {row.id: (row.version, bool(row.summarized)) for row in rows}
        changed = [row.id for row in rows if row.id not in cache.versioned or cache.versioned[row.id].key != keys[row.id]]
        if changed:
            loaded = store.monitoring_rows(session, changed)
            rounds_of: dict[int, list[Any]] = {experiment_id: [] for experiment_id in changed}
            for round_row in loaded["rounds"]:
                rounds_of[round_row.experiment_id].append(round_row)
            for experiment_id in changed:
                heavy = loaded["experiments"].get(experiment_id)
                if heavy is None:  # deleted meanwhile
                    continue
                cache.versioned[experiment_id] = _VersionedMetrics(
                    key=keys[experiment_id], config=heavy.config, state=heavy.state, rounds=rounds_of[experiment_id],
                    regret_sum=loaded["regret_sums"].get(experiment_id),
                    arm_names=loaded["arm_names"].get(experiment_id, []))
        for gone in set(cache.versioned) - set(keys):  # archived or deleted
            cache.versioned.pop(gone)
            cache.traffic.pop(gone, None)
        totals = store.round_totals(session, list(keys))
        last_beat = store.last_heartbeat(session)
        sources = store.source_statuses(session)
        experiments, rounds, regret_sums, arm_names, traffic, stored = [], [], {}, {}, {}, {}
        round_units: dict[int, dict[int, float]] = {}
        observations: dict[int, int] = {}
        late: dict[int, int] = {}
        for experiment_id, round_index, units, round_observations, round_late in totals:
            round_units.setdefault(experiment_id, {})[round_index] = float(units or 0)
            observations[experiment_id] = observations.get(experiment_id, 0) + int(round_observations or 0)
            late[experiment_id] = late.get(experiment_id, 0) + int(round_late or 0)
        for row in rows:
            versioned = cache.versioned.get(row.id)
            if versioned is None:
                continue
            experiments.append(MonitoredExperiment(
                id=row.id, name=row.name, status=row.status, round_index=row.round_index,
                applied_rounds=row.applied_rounds, updated_at=row.updated_at, config=versioned.config,
                state=versioned.state))
            rounds.extend(versioned.rounds)
            if versioned.regret_sum is not None:
                regret_sums[row.id] = versioned.regret_sum
            arm_names[row.id] = versioned.arm_names
            n_arms = len(versioned.arm_names)
            stored[row.id] = observations.get(row.id, 0)
            current = next(((round_row.index, round_row.probabilities) for round_row in versioned.rounds
                            if round_row.index == row.round_index), None)
            running = cache.traffic.get(row.id)
            if running is None or running.expected.shape != (n_arms,):
                running = cache.traffic[row.id] = _Traffic(n_arms)
            running.update(uow, session, row.id, round_units.get(row.id, {}), current)
            traffic[row.id] = (running.units, late.get(row.id, 0), running.srm)
    return {"experiments": experiments, "rounds": rounds, "regret_sums": regret_sums, "stored": stored,
            "arm_names": arm_names, "traffic": traffic, "last_heartbeat": last_beat, "sources": sources}


_cache_lock = threading.Lock()


def last_heartbeat(uow: UnitOfWork) -> datetime | None:
    with uow.read() as session:
        return store.last_heartbeat(session)


@dataclass(frozen=True)
class HealthReport:
    reachable: bool
    error: str | None  # why the database is unreachable: an error class name, or the deadline missed
    current: str | None  # schema revision
    head: str
    alive: bool
    last_heartbeat: datetime | None
    #: ``(experiment, source error view)`` of every running experiment whose metric source is failing.
    failing_sources: tuple[tuple[str, dict[str, Any]], ...] = ()


def _read_health(uow: UnitOfWork, head: str) -> tuple[str | None, datetime | None, tuple]:
    """(schema revision, newest scheduler heartbeat or None, failing metric sources)."""
    from .. import migrations_package

    migrations = migrations_package()
    current = migrations.current_revision(uow.database.engine)
    if current != head:
        return current, None, ()
    with uow.read() as session:
        beat = store.last_heartbeat(session)
        failing = tuple((row.name, source_error_view(row)) for row in store.source_statuses(session)
                        if row.error is not None and row.status == "running")
    return current, beat, failing


class _HealthCheck:
    """At most one database check of the application in flight; callers share it."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pasto-healthz")
        self._lock = threading.Lock()
        self._running: Future | None = None

    def check(self, uow: UnitOfWork, head: str, timeout: float):
        with self._lock:
            if self._running is None or self._running.done():
                self._running = self._executor.submit(_read_health, uow, head)
            running = self._running
        return running.result(timeout=timeout)


_health_checks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> _HealthCheck


def health(uow: UnitOfWork, alive_within: timedelta, timeout: float) -> HealthReport:
    """Database reachable, schema at the newest migration, a scheduler heartbeat within ``alive_within``.

    Answers within ``timeout`` seconds whatever the database does: the check runs in a thread of its
    own and, when it takes longer (a stalled server, a connect attempt waiting for its own timeout),
    the report says unreachable at once while the check finishes in the background. Later calls wait
    for that same check rather than start another, so a stalled database never piles up checks.
    """
    from .. import migrations_package

    migrations = migrations_package()
    head = migrations.head_revision()
    with _cache_lock:
        checks = _health_checks.setdefault(uow.database.engine, _HealthCheck())
    try:
        current, beat, failing = checks.check(uow, head, timeout)
    except FutureTimeout:
        return HealthReport(reachable=False, error=f"no answer within {timeout:g} s (PASTO_HEALTHZ_TIMEOUT)",
                            current=None, head=head, alive=False, last_heartbeat=None)
    except DATABASE_ERRORS as error:
        if is_unavailable_error(error):
            uow.database.status.failed(error)
        return HealthReport(reachable=False, error=type(error).__name__, current=None, head=head, alive=False,
                            last_heartbeat=None)
    alive = beat is not None and utcnow() - beat <= alive_within
    return HealthReport(reachable=True, error=None, current=current, head=head, alive=alive, last_heartbeat=beat,
                        failing_sources=failing)
