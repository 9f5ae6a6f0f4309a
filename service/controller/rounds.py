"""Rounds: closing them and running the PASTO update (the close transaction).

Timeline of round r (``round_seconds`` long, ``settle_seconds`` of grace for late data):

- ``started_at``..``ends_at``: round r is served; assignment uses its probabilities and round index.
- at ``ends_at`` the round closes and round r + 1 starts at once, with the newest mixture available.
- at ``ends_at + settle_seconds`` the update for round r runs (``pasto.algorithm.update`` with round r's
  statistics, the pooled statistics of rounds <= r, and round r's served probabilities as the
  propensities). Observations for round r that arrive before that are on time; later ones are late.

With ``settle_seconds = 0`` (the default) the update runs when the round closes, in the same
transaction, so round r + 1 is served the mixture learned from round r. With a settle time, round
r + 1 is served the newest mixture whose update has run, and round r's update applies from the
first round that starts after it. A manual close (``POST .../rounds``) closes the current round
and runs every pending update at once, ignoring the settle time; a round closed early that way gets
the close time as its ``ends_at``, so the history's rounds never overlap. A round closes when the scheduler
next runs after ``ends_at`` and the next round starts then: a scheduler that was down for a while
produces one long round, not a burst of empty catch-up rounds.

Every close is one transaction holding the experiment row lock, with a compare-and-set
(``WHERE round_index = :i AND applied_rounds = :a``) on the experiment row: two schedulers, or a
scheduler and an admin, can never apply the same round twice, and a crash leaves the round open.
A round's summary (objective, regret, guardrails) is computed after that transaction, from what the
transaction stored with the update (``rounds.summary_input``: for the last round it applies, a reference
to the experiment's state and running totals, written in full by the next update before it changes
them); a summary a crash lost is stored by the next tick. Experiments with a metric source close in threads of their own, off the scheduler's tick
(:class:`SourceCloses`), so a slow source delays no other experiment.

Pooled statistics (``service.store``) are running totals, so a close costs the same in round 1,000 as in round 1.
``pooled_arrays`` holds the sums of the rows of every applied round (per segment and metric, the K
arms' totals as arrays: migration 0018); observations ingestion
accepts for a round already applied (late data) go to that round's row and, in the same
transaction, to ``late_statistics``. The update of round r adds round r's rows (read, not written)
and the late cells into the totals and empties ``late_statistics``: the totals are then exactly the
pooled statistics of rounds <= r, late data included, while rows of rounds > r (served while r
settled) wait for their own update. Diagnostics read the totals plus the late cells plus the rows of
the rounds not applied yet, without writing. Float sums are accumulated update by update, so they
can differ in the last bits from one aggregate over all rows.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from pasto.algorithm import (DETECTOR_SNAPSHOTS, AlgorithmConfig, ControllerState, EstimationConfig,
                             detector_snapshots_read, round_generator, update)
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.segments import (SegmentedConfig, SegmentedState, add_segments, aggregate_state, measured_shares,
                            pool_segments, segmented_update)

from .. import events, store
from ..cache import Snapshot
from ..errors import ApiError
from ..models import utcnow
from ..responses import RoundSummary
from .experiments import (algorithm_and_objective, dump_segment_state, expected_shares, load_segment_state,
                          segmented_config)
from .reports import round_summary, segment_observations, segment_summary
from ..sources import SourceLimits
from ..store import UnitOfWork
from .sources import SourceFailed, SourceResults, apply_results, due_work, fetch_due_rounds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundAdvance:
    """What one close transaction did."""

    experiment: str
    closed_round: int | None  # the round that closed (None: only settled updates ran)
    applied: tuple[int, ...]  # rounds whose update ran, in order
    round_index: int  # the round served now
    duration_seconds: float
    lag_seconds: float = 0.0  # how long after its ends_at the round closed
    deployed: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _PendingSummary:
    """What :func:`~service.controller.reports.round_summary` needs for one applied round, computed
    after the lock is released."""

    round_index: int
    algorithm: AlgorithmConfig
    objective: Objective
    state: ControllerState
    pooled: Statistics
    propensities: np.ndarray
    # Segmented experiments: the segmented configuration and state, per-segment pooled statistics
    # (S, M, K) and the traffic shares the update used.
    segmented: SegmentedConfig | None = None
    segment_state: SegmentedState | None = None
    segment_pooled: Statistics | None = None
    shares: np.ndarray | None = None
    segment_names: list[str] | None = None


class _LostRace(Exception):
    """The compare-and-set found the experiment changed: another process closed the round."""


def close_current_round(uow: UnitOfWork, name: str, expected_round_index: int | None,
                        limits: SourceLimits | None = None) -> tuple[RoundAdvance, Snapshot]:
    """The admin's close of experiment ``name``'s current round (only if it is
    ``expected_round_index``, when given); 409 when it is not running or the round is not current.
    ``limits``: the deadlines of a metric source's query (``PASTO_SOURCE_*``)."""
    snapshot = uow.cache.get(name)
    expected = snapshot.round_index if expected_round_index is None else expected_round_index
    if snapshot.status != "running":
        raise ApiError(409, "conflict", f"Experiment {name!r} is {snapshot.status}; only a running experiment's "
                                        "round can be closed.")
    try:
        advance = close_round(uow, snapshot.id, expected, limits=limits,
                              has_source=snapshot.config.get("source") is not None)
    except SourceFailed as error:
        raise ApiError(502, "source_failed", f"Round {expected} of {name!r} cannot close: {error} "
                                             "The round stays open and is served as before.") from None
    if advance is None:
        raise ApiError(409, "conflict", f"Round {expected} of {name!r} is not the current round "
                                        "(it was already closed, or has not started).")
    return advance, uow.cache.get(name, fresh=True)


def close_round(uow: UnitOfWork, experiment_id: int, expected_round_index: int,
                now: datetime | None = None, limits: SourceLimits | None = None, has_source: bool = True
                ) -> RoundAdvance | None:
    """Close round ``expected_round_index`` now and run every pending update, settle time ignored.

    Returns None, changing nothing, when the round is no longer the current one (someone else
    closed it) or the experiment is not running. :class:`~service.controller.sources.SourceFailed`
    (nothing changed) when the experiment's metric source fails. ``has_source`` False: the caller knows
    the experiment declares no metric source, so none is looked for.
    """
    return _advance(uow, experiment_id, now or utcnow(), manual=True, expected_round_index=expected_round_index,
                    limits=limits, has_source=has_source)


class SourceCloses:
    """Source experiments' closes, run off the scheduler's tick, at most ``workers`` at once.

    A source query can take minutes (or hang until its statement timeout); run in the tick, it would
    hold every other experiment's close and the scheduler's heartbeat. The tick hands each due source
    experiment here instead and goes on. Each close runs in a daemon thread of its own (a hung query
    never holds the process's exit); an experiment whose previous close is still running, or one
    that finds ``workers`` closes running, is not started: the next tick looks at it afresh.
    """

    def __init__(self, uow: UnitOfWork, workers: int, limits: SourceLimits, clock=utcnow) -> None:
        self._uow = uow
        self._workers = workers
        self._limits = limits
        self._clock = clock
        self._running: set[int] = set()
        self._lock = threading.Lock()

    def submit(self, experiment_id: int) -> bool:
        """Start closing ``experiment_id``; False when it is already closing or every worker is busy."""
        with self._lock:
            if experiment_id in self._running or len(self._running) >= self._workers:
                return False
            self._running.add(experiment_id)
        threading.Thread(target=self._close, args=(experiment_id,), name=f"pasto-source-{experiment_id}",
                         daemon=True).start()
        return True

    def running(self) -> set[int]:
        """The experiments whose close is running now."""
        with self._lock:
            return set(self._running)

    def _close(self, experiment_id: int) -> None:
        try:
            advance = _close_one(self._uow, experiment_id, self._clock(), self._limits)
            if advance is not None:
                log.info("Experiment %s: closed round %s, applied %s, now serving round %s (%.1f ms)",
                         advance.experiment, advance.closed_round, list(advance.applied), advance.round_index,
                         advance.duration_seconds * 1000)
        finally:
            with self._lock:
                self._running.discard(experiment_id)


def close_due_rounds(uow: UnitOfWork, now: datetime | None = None, *,
                     limits: SourceLimits | None = None, source_closes: SourceCloses | None = None
                     ) -> list[RoundAdvance]:
    """Close every running experiment's round whose ``ends_at`` has passed and run due updates.

    The scheduler's job (``service.scheduler``), a plain function so it can be called and tested
    without a scheduler. Safe to run concurrently in several processes. First stores the summaries a
    crash or a failed write left missing (:func:`repair_summaries`). With ``source_closes``,
    experiments with a metric source are handed to it and closed off this call (their advances are
    not in the returned list); without, they are closed here, one after the other.
    """
    now = now or utcnow()
    limits = limits or SourceLimits()
    repair_summaries(uow, now)
    advances = []
    for experiment_id, has_source in store.due_experiments(uow.database, now):
        if has_source and source_closes is not None:
            source_closes.submit(experiment_id)
            continue
        advance = _close_one(uow, experiment_id, now, limits, has_source)
        if advance is not None:
            advances.append(advance)
    return advances


def _close_one(uow: UnitOfWork, experiment_id: int, now: datetime, limits: SourceLimits,
               has_source: bool = True) -> RoundAdvance | None:
    """One experiment's due close; None when nothing was due, it failed, or another process closed it."""
    try:
        return _advance(uow, experiment_id, now, manual=False, limits=limits, has_source=has_source)
    except SourceFailed:  # stored and logged; the round stays open and the next tick tries again
        return None
    except Exception:  # one broken experiment must not stop the others from advancing
        log.exception("Closing the round of experiment %s failed", experiment_id)
        return None


def record_heartbeat(uow: UnitOfWork, scheduler: str, now: datetime) -> None:
    """The scheduler ``scheduler`` (``host:pid``) ran at ``now`` (``/healthz`` tells from the newest
    heartbeat whether one is alive)."""
    store.write_heartbeat(uow.database, scheduler, now)


def record_controller_start(uow: UnitOfWork, scheduler: str, now: datetime) -> int:
    """The scheduler ``scheduler`` started at ``now``: a ``controller_started`` event in its current
    round for every experiment not stopped; returns how many were recorded."""
    return store.add_controller_start(uow.database, scheduler, now)


def _advance(uow: UnitOfWork, experiment_id: int, now: datetime, *, manual: bool,
             expected_round_index: int | None = None, limits: SourceLimits | None = None,
             has_source: bool = True) -> RoundAdvance | None:
    started = time.perf_counter()
    summaries: list[_PendingSummary] = []
    # A metric source is queried before the write transaction: a slow warehouse holds no lock. An
    # experiment known to have none skips that read (the close transaction checks again: an experiment
    # with a source is not advanced without its results).
    source_results = None if not has_source else fetch_due_rounds(
        uow, experiment_id, now, manual=manual, expected_round_index=expected_round_index,
        limits=limits or SourceLimits())
    try:
        with uow.write() as session:
            result = _advance_in(uow, session, experiment_id, now, manual, expected_round_index, summaries,
                                 source_results, started)
            if result is None:
                return None
    except _LostRace:
        return None
    result = dataclasses.replace(result, duration_seconds=time.perf_counter() - started)
    try:
        _store_summaries(uow, experiment_id, summaries)
    except Exception:  # the round is closed and applied; only its report is missing
        log.exception("Summarising rounds %s of experiment %s failed",
                      [pending.round_index for pending in summaries], experiment_id)
    if result.closed_round is not None or result.applied:
        events.round_closed.send(result.experiment, round_index=result.closed_round, applied=result.applied,
                                 duration_seconds=result.duration_seconds, lag_seconds=result.lag_seconds)
    return result


def _advance_in(uow: UnitOfWork, session, experiment_id: int, now: datetime, manual: bool,
                expected_round_index: int | None, summaries: list[_PendingSummary],
                source_results: SourceResults | None = None,
                started: float | None = None) -> RoundAdvance | None:
    # Exclusive row lock: ingestion takes it shared, so no observation lands while this transaction
    # adds statistics into the totals (store.fold_statistics relies on it) or decides which rounds are late.
    experiment = store.lock_experiment(session, experiment_id)
    if experiment is None or experiment.status != "running":
        return None
    if expected_round_index is not None and experiment.round_index != expected_round_index:
        return None
    config = experiment.config
    settle = timedelta(seconds=config["settle_seconds"])
    current_index = experiment.round_index
    rounds = store.rounds_from(session, experiment_id, experiment.applied_rounds)
    current = rounds[current_index]
    work = due_work(current_index, experiment.applied_rounds, {index: row.ends_at for index, row in rounds.items()},
                    settle, now, manual)
    closing, due = work.closing, list(work.due)
    if not closing and not due:
        return None
    # A source experiment advances only with its source's results of this tick, applied first.
    if config.get("source") is not None and not apply_results(uow, session, experiment, work,
                                                               source_results, now):
        return None

    state = ControllerState.from_dict(experiment.state)
    segment_state = segment_names = None
    if experiment.segment_state is not None:
        segment_state, segment_names = load_segment_state(experiment.segment_state)
    snapshots: dict[str, Any] = {}  # the detector's snapshots this close read: name -> value read
    if due:
        algorithm, objective = algorithm_and_objective(uow, session, experiment_id, config)
        segmented = segmented_config(config, algorithm)
        if segmented is None:
            # The detector's snapshots live apart from the state (migration 0019): read only those
            # the update reads (the window origins when it looks), so only those can change.
            names = detector_snapshots_read(algorithm, state.round_index, len(due))
            documents = store.read_detector_snapshots(session, experiment_id, names)
            if documents:
                state = state.with_detector_snapshots(documents)
            snapshots = {name: getattr(state, name) for name in names}
        if experiment.applied_rounds > 0:
            # Before this close changes the state and the totals: the previous round's summary, if still
            # missing, keeps what it is computed from.
            _keep_summary_input(session, experiment_id, experiment.applied_rounds - 1, config, algorithm,
                                objective, state, segment_state, segment_names)
        spec = config.get("segments") or {}
        if spec.get("by") is not None:
            # Open set: values that reached min_units get their own mixture, starting from the long
            # tail's (segment 0); their observations so far stay in the long tail's statistics.
            graduated = store.graduate_segment_values(session, experiment_id, spec["min_units"],
                                                      spec["max_segments"] + 1 - len(segment_names), segment_names)
            segment_state = add_segments(segment_state, len(graduated), template=0)
            segment_names = segment_names + graduated
        for index in due:
            # (S, M, K): one segment for an unsegmented experiment.
            segment_round, segment_pooled = store.update_statistics(
                uow.database, session, experiment_id, index, 1 if segmented is None else segment_state.n_segments,
                objective.n_metrics, state.n_arms)
            pooled = pool_segments(segment_pooled)  # over segments: the aggregate's pooled statistics
            propensities = np.asarray(rounds[index].probabilities, dtype=np.float64)
            if segmented is None:
                state = update(algorithm, objective, state, pool_segments(segment_round), pooled,
                               propensities=propensities, rng=round_generator(experiment.seed, index + 1))
                summaries.append(_PendingSummary(index, algorithm, objective, state, pooled, propensities))
                store.record_summary_input(rounds[index], _summary_input(summaries[-1], reference=index == due[-1]))
            else:
                shares = measured_shares(segment_observations(segment_pooled),
                                         expected_shares(config, segment_state.n_segments))
                served = np.asarray(rounds[index].segment_probabilities, dtype=np.float64)
                if len(served) < segment_state.n_segments:
                    # Values that got their own mixture after round `index` was served were served the
                    # long tail's (row 0); their observations of that round are in its statistics.
                    served = np.vstack([served, np.repeat(served[:1], segment_state.n_segments - len(served), axis=0)])
                segment_state = segmented_update(segmented, objective, segment_state, segment_round, segment_pooled,
                                                 shares, propensities=served,
                                                 rng=round_generator(experiment.seed, index + 1))
                state = aggregate_state(segment_state, shares)
                summaries.append(_PendingSummary(index, algorithm, objective, state, pooled, propensities, segmented,
                                                 segment_state, segment_pooled, shares, segment_names))
                store.record_summary_input(rounds[index], _summary_input(summaries[-1], reference=index == due[-1]))
            store.record_update(rounds[index], now, state.deployed.tolist())
    new_round_index = current_index + 1 if closing else current_index
    lag = 0.0
    # The round is closed before the compare-and-set (a lost race rolls it back): its row's changes,
    # the update's and the close's, are then written by one UPDATE in the flush the compare-and-set
    # triggers (on SQLite an UPDATE rewrites the whole row, its K propensities included).
    if closing:
        lag = max(0.0, (now - current.ends_at).total_seconds()) if not manual else 0.0
        closed_at = now
        if config.get("source") is not None and started is not None:
            # The round was served until this transaction commits, not until the tick began: its source
            # query ran in between (seconds, minutes at 10^8 events). The round's window, which later
            # queries of the source read, ends when the next round starts being served.
            closed_at = now + timedelta(seconds=max(0.0, time.perf_counter() - started))
        store.close_and_start_round(
            session, current, now=closed_at, next_index=new_round_index, round_seconds=config["round_seconds"],
            probabilities=state.probabilities.tolist(),
            segment_probabilities=None if segment_state is None else segment_state.probabilities.tolist(),
            scheduled_at=now)
    document = state.to_dict(arrays=True)
    apart = {name: document.pop(name, None) for name in DETECTOR_SNAPSHOTS}
    if not store.advance_experiment(session, experiment, round_index=new_round_index,
                                    applied_rounds=experiment.applied_rounds + len(due), state=document, now=now):
        raise _LostRace()
    # A snapshot the update passed on as it was read is not written again (12 M x K numbers).
    changed = [name for name, read in snapshots.items() if getattr(state, name) is not read]
    if changed:
        store.write_detector_snapshots(session, experiment_id, {name: apart[name] for name in changed})
    if segment_state is not None and due:
        store.write_segment_state(session, experiment_id, dump_segment_state(segment_state, segment_names))
    return RoundAdvance(
        experiment=experiment.name, closed_round=current_index if closing else None, applied=tuple(due),
        round_index=new_round_index, duration_seconds=0.0, lag_seconds=lag, deployed=state.deployed.tolist(),
    )


def _statistics_lists(statistics: Statistics) -> list:
    return [statistics.counts.tolist(), statistics.sums.tolist(), statistics.sums_of_squares.tolist()]


def _statistics_from(lists: list) -> Statistics:
    return Statistics(*(np.asarray(values, dtype=np.float64) for values in lists))


#: The key of a summary input that refers to the experiment's row (see :func:`_summary_input`).
_REFERENCE = "from_experiment"


def _summary_input(pending: _PendingSummary, reference: bool = False) -> dict:
    """What :func:`_summary` needs of a round beyond the experiment's configuration, as a JSON document
    (written with the round's update, so that a summary lost to a crash can be computed later). Its
    large arrays stay numpy arrays: the column stores them packed (``service.models.PackedArraysJSON``).
    The state goes without the change detector's origins (``change_origin``, ``window_origins``: 12 M
    of its 6 + 12 M arrays of K numbers with safe serving), which the summary does not read.

    ``reference``: the round is the last one this close applies, so what its summary is computed from
    is what the close stores anyway (the experiment's state and segment state, the running totals, the
    round's propensities) and stays so until the next update, which runs :func:`_keep_summary_input`
    first: the input only names the experiment's ``applied_rounds`` it holds for (at K = 100,000 the
    full input is 17.6 MB, 12 MB of it the pooled statistics, written and cleared on every close)."""
    if reference:
        return {_REFERENCE: {"applied_rounds": pending.round_index + 1}}
    report_state = dataclasses.replace(pending.state, change_origin=None, window_origins=None)
    data = {"state": report_state.to_dict(arrays=True),
            "pooled": [pending.pooled.counts, pending.pooled.sums, pending.pooled.sums_of_squares],
            "propensities": np.asarray(pending.propensities, dtype=np.float64)}
    if pending.segmented is not None:
        data.update(segment_state=dump_segment_state(pending.segment_state, pending.segment_names),
                    segment_pooled=_statistics_lists(pending.segment_pooled),
                    shares=np.asarray(pending.shares, dtype=np.float64).tolist())
    return data


def _referenced_pending(session, experiment_id: int, round_index: int, config: dict, algorithm: AlgorithmConfig,
                        objective: Objective, state: ControllerState, segment_state: SegmentedState | None,
                        segment_names: list[str] | None) -> _PendingSummary:
    """The :class:`_PendingSummary` of round ``round_index`` rebuilt from the experiment's stored state
    (``state``, ``segment_state``: those the round's update wrote), the running totals and the round's
    propensities, while the experiment's ``applied_rounds`` is still ``round_index + 1``: the same
    arrays, bit for bit, that the close passed to the summary."""
    segmented = segmented_config(config, algorithm)
    n_segments = 1 if segmented is None else segment_state.n_segments
    segment_pooled = store.pooled_totals(session, experiment_id, (n_segments, objective.n_metrics, state.n_arms))
    propensities = np.asarray(store.round_propensities(session, experiment_id, round_index), dtype=np.float64)
    pending = _PendingSummary(round_index, algorithm, objective, state, pool_segments(segment_pooled), propensities)
    if segmented is None:
        return pending
    shares = measured_shares(segment_observations(segment_pooled), expected_shares(config, n_segments))
    return dataclasses.replace(pending, segmented=segmented, segment_state=segment_state,
                               segment_pooled=segment_pooled, shares=shares, segment_names=segment_names)


def _pending_from_experiment(session, experiment_id: int, round_index: int, reference: dict, config: dict,
                             algorithm: AlgorithmConfig, objective: Objective) -> _PendingSummary:
    """The repair of a summary input that refers to the experiment (read transaction: one snapshot)."""
    row = store.experiment_state(session, experiment_id)
    if row.applied_rounds != reference["applied_rounds"]:
        # Cannot happen while every update keeps the input first (_keep_summary_input).
        raise RuntimeError(f"The summary input of round {round_index} refers to the experiment after "
                           f"{reference['applied_rounds']} applied rounds; it is at {row.applied_rounds}.")
    segment_state = segment_names = None
    if row.segment_state is not None:
        segment_state, segment_names = load_segment_state(row.segment_state)
    return _referenced_pending(session, experiment_id, round_index, config, algorithm, objective,
                               ControllerState.from_dict(row.state), segment_state, segment_names)


def _keep_summary_input(session, experiment_id: int, round_index: int, config: dict, algorithm: AlgorithmConfig,
                        objective: Objective, state: ControllerState, segment_state: SegmentedState | None,
                        segment_names: list[str] | None) -> None:
    """In the close transaction, before the update changes the state and the totals: when round
    ``round_index`` (the last applied) has no summary yet and its input refers to the experiment, write
    the input in full (from the state the close read and the totals before this close adds to them).
    Normally its summary was stored right after its close, and this is one indexed read."""
    stored = store.unsummarized_input(session, experiment_id, round_index)
    if stored is None or _REFERENCE not in stored:
        return
    pending = _referenced_pending(session, experiment_id, round_index, config, algorithm, objective, state,
                                  segment_state, segment_names)
    store.replace_summary_input(session, experiment_id, round_index, _summary_input(pending))


def repair_summaries(uow: UnitOfWork, now: datetime) -> list[tuple[int, int]]:
    """Compute and store the summaries of applied rounds that have none: their close committed, and the
    process died (or the write failed) before the summary was stored. Returns ``(experiment_id,
    round_index)`` of those repaired. Rounds applied in the last few seconds are left to the process
    that applied them (computing one twice is harmless: the first stored summary is kept)."""
    repaired = []
    for experiment_id, round_index, data in store.pending_summaries(uow.database, now - timedelta(seconds=2)):
        try:
            with uow.read() as session:
                experiment = store.read_experiment(session, experiment_id)
                if experiment is None:
                    continue
                algorithm, objective = algorithm_and_objective(uow, session, experiment_id, experiment.config)
                if _REFERENCE in data:
                    pending = _pending_from_experiment(session, experiment_id, round_index, data[_REFERENCE],
                                                       experiment.config, algorithm, objective)
            if _REFERENCE not in data:
                pending = _PendingSummary(round_index, algorithm, objective, ControllerState.from_dict(data["state"]),
                                          _statistics_from(data["pooled"]), np.asarray(data["propensities"]))
                if "segment_state" in data:
                    segment_state, names = load_segment_state(data["segment_state"])
                    pending = dataclasses.replace(
                        pending, segmented=segmented_config(experiment.config, algorithm), segment_state=segment_state,
                        segment_pooled=_statistics_from(data["segment_pooled"]), shares=np.asarray(data["shares"]),
                        segment_names=names)
            store.store_summaries(uow.database, experiment_id, [(round_index, _summary(pending))])
        except Exception:  # the database went away, or the summary itself fails: the next tick tries again
            log.exception("Repairing the summary of round %s of experiment %s failed", round_index, experiment_id)
            continue
        log.info("Experiment %s: stored the missing summary of round %s", experiment.name, round_index)
        repaired.append((experiment_id, round_index))
    return repaired


def _store_summaries(uow: UnitOfWork, experiment_id: int, summaries: list[_PendingSummary]) -> None:
    """Compute and store the reporting summaries of applied rounds, outside the close transaction.

    The exact optimum behind the regret estimate is the slowest part of a close at large K; doing it
    after the experiment row is unlocked keeps ingestion and assignment refreshes from waiting on it.
    What the summaries are computed from was written with the close (``rounds.summary_input``): a
    crash in between, or a failed write, leaves it, and the next tick's :func:`repair_summaries`
    stores the summary from it.
    """
    if not summaries:
        return
    store.store_summaries(uow.database, experiment_id, [(pending.round_index, _summary(pending)) for pending in summaries])


def _summary(pending: _PendingSummary) -> RoundSummary:
    """The stored summary of one applied round (segmented: with its per-segment part under ``segments``)."""
    if pending.segmented is None:
        return round_summary(pending.algorithm, pending.objective, pending.state, pending.pooled, pending.propensities)
    # The aggregate reads pooled statistics: the per-segment estimator accumulators have no aggregate.
    return round_summary(dataclasses.replace(pending.algorithm, estimation=EstimationConfig()),
                         pending.objective, pending.state, pending.pooled, pending.propensities,
                         segments=segment_summary(pending.segmented, pending.objective, pending.segment_state,
                                                  pending.segment_pooled, pending.shares, pending.segment_names))
