"""Warehouse-native rounds: an experiment's metric source, queried at its rounds' close and update.

An experiment that declares a ``source`` (``config["source"]``, see ``service.sources.spec``) gets its
rounds' statistics from the engine that holds its events. Around each close transaction
(``service.controller.rounds``) the scheduler:

1. decides, from the experiment as it is (one read), whether a close or an update is due; if neither,
   the source is not queried;
2. queries the source (:func:`fetch_due_rounds`) **outside any write transaction**, so a slow warehouse
   never holds a database lock: every round that has ended and whose update has not run (they are
   restated: their latest result replaces the previous one) and, when an update is due, the
   ``late_rounds`` applied rounds before it (rows that landed there since count as late);
3. applies the results in the close transaction (:func:`apply_results`), under the experiment's
   exclusive row lock, before the update folds the round's statistics.

Idempotence: ``source_cells`` / ``source_units`` hold the source's latest result per round;
applying a new result adds only the difference (new minus stored) to ``round_statistics`` and
``arm_round_counts``, and, for a round whose update already ran, to ``late_statistics`` too (exactly
what the webhook does with a late observation), then stores the new result. A row of the warehouse is
therefore counted once however often its round is restated, and source cells add to the webhook's
observations of the same round. A result is applied only if its queries began after those of the
newest applied result (two schedulers: the slower, older answer is dropped, not applied over a newer
one), and an update runs only with a result of its round from the same tick.

A failing source (:class:`SourceFailed`) leaves everything as it is: the round stays open and served,
the failure's sentence is stored (``source_status``: shown by the round history, diagnostics,
``/healthz``, ``pasto_source_errors_total`` and the dashboard), and the next tick tries again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from .. import store
from ..models import utcnow
from ..sources import RoundStatistics, RoundWindow, SourceError, SourceLimits, fetch_round_statistics, parse_source
from ..sources.sandbox import display_message
from ..sources.spec import MAX_LATE_ROUNDS
from ..store import UnitOfWork

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DueWork:
    """What a close transaction would do now: close the current round, and run which updates."""

    closing: bool
    last_closed: int  # the newest round that has ended (or ends now)
    due: tuple[int, ...]  # rounds whose update runs, in order


def due_work(round_index: int, applied_rounds: int, ends_at: Mapping[int, datetime], settle: timedelta,
             now: datetime, manual: bool) -> DueWork:
    """The close and updates due at ``now`` (``ends_at``: planned end of rounds >= ``applied_rounds``).

    Updates run in round order: the list stops at the first one not due yet.
    """
    closing = manual or ends_at[round_index] <= now
    last_closed = round_index if closing else round_index - 1
    due = []
    for index in range(applied_rounds, last_closed + 1):
        if not (manual or ends_at[index] + settle <= now):
            break
        due.append(index)
    return DueWork(closing, last_closed, tuple(due))


@dataclass(frozen=True)
class SourceResults:
    """One tick's results of an experiment's source.

    Attributes
    ----------
    started_at : datetime
        When the first of the tick's queries began.
    rounds : mapping of int to RoundStatistics
        Round index -> its statistics (shape (M, K)) and units (shape (K,)).
    """

    started_at: datetime
    rounds: Mapping[int, RoundStatistics]


class SourceFailed(Exception):
    """The experiment's source could not give a round's statistics; the message is the source's sentence
    (already stored as the experiment's source error)."""


def declared_source(config: Mapping[str, Any]):
    """The experiment's parsed :class:`~service.sources.MetricSource`, or None without one."""
    declaration = config.get("source")
    return None if declaration is None else parse_source(declaration)


def fetch_due_rounds(uow: UnitOfWork, experiment_id: int, now: datetime, *, manual: bool,
                     expected_round_index: int | None = None,
                     limits: SourceLimits = SourceLimits()) -> SourceResults | None:
    """Query the experiment's source for the rounds the close at ``now`` needs (see the module docstring).

    Returns None (nothing queried) when the experiment has no source, is not running, or has nothing
    due. Raises :class:`SourceFailed` after storing the error when a query fails.
    """
    with uow.read() as session:
        experiment = store.read_experiment(session, experiment_id)
        if experiment is None or experiment.status != "running" or experiment.config.get("source") is None:
            return None
        if expected_round_index is not None and experiment.round_index != expected_round_index:
            return None
        rounds = {index: (row.started_at, row.ends_at, row.closed_at) for index, row in store.rounds_from(
            session, experiment_id, max(0, experiment.applied_rounds - MAX_LATE_ROUNDS)).items()}
        arms = store.arm_names(session, experiment_id)
    try:
        source = declared_source(experiment.config)
    except SourceError as error:  # stored before a stricter check: shown like any failure
        _failed(uow, experiment_id, experiment.name, None, str(error))
    # The round the previous update applied is re-queried at least once: what was served between its
    # query and its close's commit landed after that query (late_rounds = 0 re-queries it all the same).
    first = max(0, experiment.applied_rounds - max(source.late_rounds, 1))
    work = due_work(experiment.round_index, experiment.applied_rounds,
                    {index: times[1] for index, times in rounds.items()},
                    timedelta(seconds=experiment.config["settle_seconds"]), now, manual)
    if not work.closing and not work.due:
        return None
    indices = list(range(experiment.applied_rounds, work.last_closed + 1))
    if work.due:
        indices = list(range(first, experiment.applied_rounds)) + indices
    started_at = utcnow()
    results: dict[int, RoundStatistics] = {}
    for index in indices:
        round_started, _, closed_at = rounds[index]
        # A round is served until its close commits (the current one: at least until now); with a round
        # column its last exposure extends that (service.sources.query, rule 3).
        window = RoundWindow(index, round_started, closed_at if closed_at is not None else now)
        try:
            results[index] = fetch_round_statistics(source, experiment.name, window, arms,
                                                    experiment.config["metrics"], limits)
        except SourceError as error:
            _failed(uow, experiment_id, experiment.name, index, str(error))
        except Exception as error:  # a driver's exception the source step does not know: shown all the same
            log.exception("Experiment %s: the metric source raised an unexpected error", experiment.name)
            _failed(uow, experiment_id, experiment.name, index,
                    f"The metric source failed unexpectedly: {type(error).__name__}: {display_message(str(error))}")
    return SourceResults(started_at, results)


def _failed(uow: UnitOfWork, experiment_id: int, name: str, round_index: int | None, message: str):
    """Store and log a source failure, and raise :class:`SourceFailed`."""
    store.record_source_failure(uow.database, experiment_id, message, utcnow())
    log.warning("Experiment %s: the metric source failed (round %s); the round stays open and is retried at "
                "the next tick: %s", name, round_index, message)
    raise SourceFailed(message)


def apply_results(uow: UnitOfWork, session, experiment, work: DueWork, results: SourceResults | None,
                  now: datetime) -> bool:
    """Apply a tick's source results in the close transaction (the experiment's row locked exclusively).

    Returns False, changing nothing, when the results cannot be used: missing (a source experiment is
    not advanced without them), without a due round, or older than the newest applied ones.
    """
    if results is None or any(index not in results.rounds for index in work.due):
        return False
    newest = store.source_fetch_started_at(session, experiment.id)
    if newest is not None and newest >= results.started_at:
        return False
    applied_rounds = experiment.applied_rounds
    cell_changes: list[tuple[int, int, int, int, int, float, float]] = []  # segment 0: a source feeds no segments
    count_changes: list[tuple[int, int, int, int, int]] = []
    for index in sorted(results.rounds):
        result = results.rounds[index]
        statistics = result.statistics
        old_cells, old_units = store.source_round(session, experiment.id, index)
        metric, arm = np.nonzero(statistics.counts)
        new_cells = {(int(k), int(m)): (int(statistics.counts[m, k]), float(statistics.sums[m, k]),
                                        float(statistics.sums_of_squares[m, k]))
                     for m, k in zip(metric.tolist(), arm.tolist())}
        # observations of a source round: per arm, the largest metric count (its events, when each
        # event carries every metric); units: distinct units with an event.
        observations = statistics.counts.max(axis=0).astype(np.int64)
        new_units = {k: (int(result.units[k]), int(observations[k]))
                     for k in range(len(result.units)) if result.units[k] or observations[k]}
        for key in sorted(set(old_cells) | set(new_cells)):
            old = old_cells.get(key, (0, 0.0, 0.0))
            new = new_cells.get(key, (0, 0.0, 0.0))
            if old != new:
                cell_changes.append((index, 0, key[0], key[1], new[0] - old[0], new[1] - old[1], new[2] - old[2]))
        for arm_index in sorted(set(old_units) | set(new_units)):
            old_unit_count, old_observations = old_units.get(arm_index, (0, 0))
            unit_count, observation_count = new_units.get(arm_index, (0, 0))
            more = observation_count - old_observations
            late = max(0, more) if index < applied_rounds else 0
            if unit_count != old_unit_count or more:
                count_changes.append((index, arm_index, more, unit_count - old_unit_count, late))
        if old_cells != new_cells or old_units != new_units:
            store.replace_source_round(
                session, experiment.id, index,
                [(k, m, *values) for (k, m), values in sorted(new_cells.items())],
                [(k, *values) for k, values in sorted(new_units.items())])
    connection = session.connection()
    store.add_statistics(connection, experiment.id, cell_changes, applied_rounds)
    store.add_arm_round_counts(connection, experiment.id, count_changes)
    store.record_source_success(uow.database, session, experiment.id, results.started_at, now)
    return True
