"""Rounds: closing them, running the PASTO update, and reporting them.

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

Pooled statistics are running totals, so a close costs the same in round 1,000 as in round 1.
``pooled_statistics`` holds the sums of the rows of every applied round; observations ingestion
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
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import sqlalchemy as sa
from flask import Blueprint, Flask, jsonify, request

from pasto import optimum
from pasto.algorithm import AlgorithmConfig, ControllerState, estimate, update
from pasto.diagnostics import guardrail_report
from pasto.estimators import Statistics
from pasto.objectives import Objective

from . import events
from .auth import require_role
from .cache import get_cache
from .db import Database, get_db
from .errors import ApiError, invalid
from .experiments import iso
from .models import (Arm, ArmRoundCount, Experiment, LateStatistic, PooledStatistic, Round, RoundStatistic,
                     utcnow)
from .params import query_integer
from .schemas import json_body

log = logging.getLogger(__name__)

bp = Blueprint("rounds", __name__, url_prefix="/api/v1/experiments")

_experiments = Experiment.__table__


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
    """What :func:`round_summary` needs for one applied round, computed after the lock is released."""

    round_index: int
    algorithm: AlgorithmConfig
    objective: Objective
    state: ControllerState
    pooled: Statistics
    propensities: np.ndarray


class _LostRace(Exception):
    """The compare-and-set found the experiment changed: another process closed the round."""


# ------------------------------------------------------------------------------------ closing
def close_round(database: Database, experiment_id: int, expected_round_index: int,
                now: datetime | None = None) -> RoundAdvance | None:
    """Close round ``expected_round_index`` now and run every pending update, settle time ignored.

    Returns None, changing nothing, when the round is no longer the current one (someone else
    closed it) or the experiment is not running.
    """
    return _advance(database, experiment_id, now or utcnow(), manual=True, expected_round_index=expected_round_index)


def close_due_rounds(app_or_database: Flask | Database, now: datetime | None = None) -> list[RoundAdvance]:
    """Close every running experiment's round whose ``ends_at`` has passed and run due updates.

    This is the scheduler's job (``service.scheduler``), a plain function so it can be called and
    tested without a scheduler. Safe to run concurrently in several processes.
    """
    database = app_or_database if isinstance(app_or_database, Database) else get_db(app_or_database)
    now = now or utcnow()
    rounds = Round.__table__
    with database.read() as session:
        candidates = session.execute(
            sa.select(_experiments.c.id)
            .join(rounds, sa.and_(rounds.c.experiment_id == _experiments.c.id,
                                  rounds.c.index == _experiments.c.round_index))
            .where(_experiments.c.status == "running")
            .where(sa.or_(rounds.c.ends_at <= now, _experiments.c.applied_rounds < _experiments.c.round_index))
            .order_by(_experiments.c.id)
        ).scalars().all()
    advances = []
    for experiment_id in candidates:
        try:
            advance = _advance(database, experiment_id, now, manual=False)
        except Exception:  # one broken experiment must not stop the others from advancing
            log.exception("Closing the round of experiment %s failed", experiment_id)
            continue
        if advance is not None:
            advances.append(advance)
    return advances


def _advance(database: Database, experiment_id: int, now: datetime, *, manual: bool,
             expected_round_index: int | None = None) -> RoundAdvance | None:
    started = time.perf_counter()
    summaries: list[_PendingSummary] = []
    try:
        with database.write() as session:
            result = _advance_in(database, session, experiment_id, now, manual, expected_round_index, summaries)
            if result is None:
                return None
    except _LostRace:
        return None
    result = dataclasses.replace(result, duration_seconds=time.perf_counter() - started)
    try:
        _store_summaries(database, experiment_id, summaries)
    except Exception:  # the round is closed and applied; only its report is missing
        log.exception("Summarising rounds %s of experiment %s failed",
                      [pending.round_index for pending in summaries], experiment_id)
    if result.closed_round is not None or result.applied:
        events.round_closed.send(result.experiment, round_index=result.closed_round, applied=result.applied,
                                 duration_seconds=result.duration_seconds, lag_seconds=result.lag_seconds)
    return result


def _advance_in(database: Database, session, experiment_id: int, now: datetime, manual: bool,
                expected_round_index: int | None, summaries: list[_PendingSummary]) -> RoundAdvance | None:
    # Exclusive row lock: ingestion takes it shared, so no observation lands while this transaction
    # adds statistics into the totals (fold_statistics relies on it) or decides which rounds are late.
    experiment = session.execute(
        sa.select(_experiments).where(_experiments.c.id == experiment_id).with_for_update()
    ).one_or_none()
    if experiment is None or experiment.status != "running":
        return None
    if expected_round_index is not None and experiment.round_index != expected_round_index:
        return None
    config = experiment.config
    settle = timedelta(seconds=config["settle_seconds"])
    current_index = experiment.round_index
    rounds = {
        row.index: row for row in session.execute(
            sa.select(Round).where(Round.experiment_id == experiment_id, Round.index >= experiment.applied_rounds)
        ).scalars()
    }
    current = rounds[current_index]
    closing = manual or current.ends_at <= now
    last_closed = current_index if closing else current_index - 1
    due = [
        index for index in range(experiment.applied_rounds, last_closed + 1)
        if manual or rounds[index].ends_at + settle <= now
    ]
    # Updates run in round order: stop at the first one that is not due.
    due = [index for position, index in enumerate(due) if index == experiment.applied_rounds + position]
    if not closing and not due:
        return None

    state = ControllerState.from_dict(experiment.state)
    if due:
        algorithm, objective = algorithm_and_objective(session, experiment_id, config)
        for index in due:
            round_row = rounds[index]
            round_statistics, pooled = update_statistics(database, session, experiment_id, index,
                                                         objective.n_metrics, state.n_arms)
            propensities = np.asarray(round_row.probabilities, dtype=np.float64)
            state = update(algorithm, objective, state, round_statistics, pooled, propensities=propensities)
            round_row.applied_at = now
            round_row.deployed = state.deployed.tolist()
            summaries.append(_PendingSummary(index, algorithm, objective, state, pooled, propensities))
    new_round_index = current_index + 1 if closing else current_index
    new_applied = experiment.applied_rounds + len(due)
    changed = session.execute(
        sa.update(_experiments)
        .where(_experiments.c.id == experiment_id,
               _experiments.c.round_index == current_index,
               _experiments.c.applied_rounds == experiment.applied_rounds)
        .values(round_index=new_round_index, applied_rounds=new_applied, state=state.to_dict(),
                version=_experiments.c.version + 1, updated_at=now)
    ).rowcount
    if changed != 1:
        raise _LostRace()
    lag = 0.0
    if closing:
        current.closed_at = now
        current.ends_at = min(current.ends_at, now)  # closed early by hand: served until now, not planned end
        lag = max(0.0, (now - current.ends_at).total_seconds()) if not manual else 0.0
        session.add(Round(
            experiment_id=experiment_id, index=new_round_index, started_at=now,
            ends_at=now + timedelta(seconds=config["round_seconds"]),
            probabilities=state.probabilities.tolist(),
        ))
    return RoundAdvance(
        experiment=experiment.name, closed_round=current_index if closing else None, applied=tuple(due),
        round_index=new_round_index, duration_seconds=0.0, lag_seconds=lag, deployed=state.deployed.tolist(),
    )


def _store_summaries(database: Database, experiment_id: int, summaries: list[_PendingSummary]) -> None:
    """Compute and store the reporting summaries of applied rounds, outside the close transaction.

    The exact optimum behind the regret estimate is the slowest part of a close at large K; doing it
    after the experiment row is unlocked keeps ingestion and assignment refreshes from waiting on it.
    A crash in between only leaves those rounds without a summary (reported as null).
    """
    if not summaries:
        return
    computed = [
        (pending.round_index, round_summary(pending.algorithm, pending.objective, pending.state, pending.pooled,
                                            pending.propensities))
        for pending in summaries
    ]
    rounds = Round.__table__
    with database.write() as session:
        for round_index, summary in computed:
            session.execute(
                sa.update(rounds)
                .where(rounds.c.experiment_id == experiment_id, rounds.c.index == round_index,
                       rounds.c.summary.is_(None))
                .values(summary=summary)
            )


def algorithm_and_objective(session, experiment_id: int, config: dict[str, Any]) -> tuple[AlgorithmConfig, Objective]:
    """The experiment's algorithm configuration and objective, rebuilt from its stored config."""
    algorithm = AlgorithmConfig.from_dict({k: v for k, v in config["algorithm"].items() if k != "preset"})
    arm_names = None
    if any(guardrail.get("relative_to") for guardrail in config["objective"].get("guardrails", [])):
        arm_names = session.execute(
            sa.select(Arm.name).where(Arm.experiment_id == experiment_id).order_by(Arm.position)
        ).scalars().all()
    return algorithm, Objective.from_spec(config["metrics"], config["objective"], arm_names=arm_names)


def fold_statistics(database: Database, session, experiment_id: int, round_index: int) -> int:
    """Add round ``round_index``'s rows and the late cells into ``pooled_statistics`` and empty
    ``late_statistics``; returns the number of (metric, arm) cells of the totals added to.

    Work proportional to one round: the round's rows are found by the primary key, the late cells
    are at most K x M. Must run in the close transaction, after the experiment row was locked
    exclusively, for the rounds in order: ingestion holds that lock shared (``service.observations``),
    so no observation lands between reading the late cells and deleting them, and the round's rows
    are final (later observations for it are late, and go to ``late_statistics`` too).
    """
    table, late, pooled = RoundStatistic.__table__, LateStatistic.__table__, PooledStatistic.__table__
    cells = sa.union_all(
        sa.select(table.c.metric_index, table.c.arm_index, table.c.count, table.c.sum, table.c.sum_of_squares)
        .where(table.c.experiment_id == experiment_id, table.c.round_index == round_index),
        sa.select(late.c.metric_index, late.c.arm_index, late.c.count, late.c.sum, late.c.sum_of_squares)
        .where(late.c.experiment_id == experiment_id),
    ).subquery()
    additions = (
        sa.select(sa.literal(experiment_id), cells.c.metric_index, cells.c.arm_index, sa.func.sum(cells.c.count),
                  sa.func.sum(cells.c.sum), sa.func.sum(cells.c.sum_of_squares))
        .group_by(cells.c.metric_index, cells.c.arm_index)
        .order_by(cells.c.metric_index, cells.c.arm_index)  # one lock order
    )
    upsert = database.insert(pooled).from_select(
        ["experiment_id", "metric_index", "arm_index", "count", "sum", "sum_of_squares"], additions)
    upsert = upsert.on_conflict_do_update(
        index_elements=[pooled.c.experiment_id, pooled.c.metric_index, pooled.c.arm_index],
        set_={column: pooled.c[column] + upsert.excluded[column] for column in ("count", "sum", "sum_of_squares")},
    )
    cells_added = session.execute(upsert).rowcount
    session.execute(sa.delete(late).where(late.c.experiment_id == experiment_id))
    return cells_added


def update_statistics(database: Database, session, experiment_id: int, round_index: int, n_metrics: int,
                      n_arms: int) -> tuple[Statistics, Statistics]:
    """Round ``round_index``'s statistics and the pooled statistics of rounds <= ``round_index``, for
    its update: adds the round and the late data into the totals (:func:`fold_statistics`), then reads
    round ``round_index``'s rows and the K x M running totals. Nothing here grows with the number of
    rounds."""
    fold_statistics(database, session, experiment_id, round_index)
    this_round = _read_statistics(
        session, "SELECT metric_index, arm_index, count, sum, sum_of_squares FROM round_statistics "
                 "WHERE experiment_id = {p} AND round_index = {p}", (experiment_id, round_index), n_metrics, n_arms)
    pooled = _read_statistics(
        session, "SELECT metric_index, arm_index, count, sum, sum_of_squares FROM pooled_statistics "
                 "WHERE experiment_id = {p}", (experiment_id,), n_metrics, n_arms)
    return this_round, pooled


def pooled_statistics(session, experiment_id: int, last_round: int, n_metrics: int, n_arms: int) -> Statistics:
    """Statistics summed over rounds <= ``last_round`` without writing (for reports): the running
    totals, the late cells, and the rows of the rounds from the first one not applied up to
    ``last_round``. One statement (``applied_rounds`` read inside it), so a close committing meanwhile
    cannot make a row count twice or not at all."""
    return _read_statistics(
        session,
        "SELECT metric_index, arm_index, SUM(count), SUM(sum), SUM(sum_of_squares) FROM ("
        "SELECT metric_index, arm_index, count, sum, sum_of_squares FROM pooled_statistics "
        "WHERE experiment_id = {p} "
        "UNION ALL SELECT metric_index, arm_index, count, sum, sum_of_squares FROM late_statistics "
        "WHERE experiment_id = {p} "
        "UNION ALL SELECT metric_index, arm_index, count, sum, sum_of_squares FROM round_statistics "
        "WHERE experiment_id = {p} AND round_index <= {p} "
        "AND round_index >= (SELECT applied_rounds FROM experiments WHERE id = {p})"
        ") AS cells GROUP BY metric_index, arm_index",
        (experiment_id, experiment_id, experiment_id, last_round, experiment_id), n_metrics, n_arms)


def _read_statistics(session, sql: str, parameters: tuple, n_metrics: int, n_arms: int) -> Statistics:
    """Rows (metric_index, arm_index, count, sum, sum_of_squares) of ``sql`` -> M x K :class:`Statistics`.

    Plain SQL on the DBAPI cursor (``{p}`` marks the parameters), straight into one float64 array: at
    K = 10,000 there are 50,000 rows, and SQLAlchemy row objects cost more than the query.
    """
    connection = session.connection()
    placeholder = "%s" if connection.dialect.paramstyle in ("format", "pyformat") else "?"
    cursor = connection.connection.cursor()
    try:
        cursor.execute(sql.format(p=placeholder), parameters)
        data = np.array(cursor.fetchall(), dtype=np.float64).reshape(-1, 5)
    finally:
        cursor.close()
    counts = np.zeros((n_metrics, n_arms))
    sums = np.zeros((n_metrics, n_arms))
    sums_of_squares = np.zeros((n_metrics, n_arms))
    metric, arm = data[:, 0].astype(np.int64), data[:, 1].astype(np.int64)
    counts[metric, arm] = data[:, 2]
    sums[metric, arm] = data[:, 3]
    sums_of_squares[metric, arm] = data[:, 4]
    return Statistics(counts=counts, sums=sums, sums_of_squares=sums_of_squares)


def round_summary(algorithm: AlgorithmConfig, objective: Objective, state: ControllerState,
                  pooled: Statistics, propensities: np.ndarray) -> dict[str, Any]:
    """Estimated quality of a round's mixture, on the estimate available right after its update."""
    current = estimate(algorithm, state, pooled)
    means = current.means
    thresholds = objective.thresholds(means)
    served_value = float(objective.mixture_value(means, propensities, thresholds))
    deployed_value = float(objective.mixture_value(means, state.deployed, thresholds))
    _, best_value = optimum.best_mixture(objective, means, thresholds)
    best_arm, best_single_value = optimum.best_single(objective, means, thresholds)
    return {
        "objective": finite(served_value),
        "objective_deployed": finite(deployed_value),
        "best_mixture": finite(best_value),
        "best_single": {"arm_index": int(best_arm), "value": finite(best_single_value)},
        "regret": finite(max(0.0, best_value - served_value)),
        "guardrails": _guardrails(objective, current, propensities),
    }


def _guardrails(objective: Objective, current, probabilities: np.ndarray) -> list[dict[str, Any]]:
    return [json_safe(item) for item in guardrail_report(objective, current, probabilities)]


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


# ------------------------------------------------------------------------------------ HTTP
@bp.post("/<name>/rounds")
@require_role("admin")
def close_current_round(name: str):
    snapshot = get_cache().get(name)
    expected = snapshot.round_index
    # Read the body whatever Content-Length says: a chunked body has none, and ignoring it would
    # close the current round when the client asked for "only if it is round N".
    if request.get_data(cache=True).strip():
        body = json_body()
        if not isinstance(body, dict) or set(body) - {"round"}:
            raise invalid("body", "The body must be empty or {\"round\": <index of the current round>}.")
        if "round" in body:
            requested = body["round"]
            if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
                raise invalid("round", "Must be a non-negative integer.")
            expected = requested
    if snapshot.status != "running":
        raise ApiError(409, "conflict", f"Experiment {name!r} is {snapshot.status}; only a running experiment's "
                                        "round can be closed.")
    advance = close_round(get_db(), snapshot.id, expected)
    if advance is None:
        raise ApiError(409, "conflict", f"Round {expected} of {name!r} is not the current round "
                                        "(it was already closed, or has not started).")
    fresh = get_cache().get(name, fresh=True)
    return jsonify({
        "closed_round": advance.closed_round,
        "applied": list(advance.applied),
        "round": {"index": fresh.round_index, "started_at": iso(fresh.round_started_at),
                  "ends_at": iso(fresh.round_ends_at)},
        "probabilities": fresh.probabilities.tolist(),
        "deployed": fresh.deployed.tolist(),
    })


#: Largest round index a request may name (rounds are 32-bit integers; SQLite overflows past 2**63).
MAX_ROUND_INDEX = 2**31 - 1


_query_integer = query_integer  # service.params: digits and bounds checked before int()


@bp.get("/<name>/rounds")
@require_role("read")
def list_rounds(name: str):
    """Every round oldest first; ``?since=<index>`` and ``?limit=<n>`` page through long histories."""
    since = _query_integer("since", 0, 0, MAX_ROUND_INDEX)
    limit = _query_integer("limit", None, 1)
    snapshot = get_cache().get(name)
    last = snapshot.round_index if limit is None else min(snapshot.round_index, since + limit - 1)
    with get_db().read() as session:
        round_rows = session.execute(
            sa.select(Round).where(Round.experiment_id == snapshot.id, Round.index >= since, Round.index <= last)
            .order_by(Round.index)
        ).scalars().all()
        statistics = session.execute(
            sa.select(RoundStatistic.round_index, RoundStatistic.metric_index, RoundStatistic.arm_index,
                      RoundStatistic.count, RoundStatistic.sum)
            .where(RoundStatistic.experiment_id == snapshot.id, RoundStatistic.round_index >= since,
                   RoundStatistic.round_index <= last)
        ).all()
        counts = session.execute(
            sa.select(ArmRoundCount.round_index, ArmRoundCount.arm_index, ArmRoundCount.observations,
                      ArmRoundCount.units, ArmRoundCount.late_observations)
            .where(ArmRoundCount.experiment_id == snapshot.id, ArmRoundCount.round_index >= since,
                   ArmRoundCount.round_index <= last)
        ).all()
    n_rounds, n_arms, n_metrics = max(0, last - since + 1), snapshot.n_arms, len(snapshot.metrics)
    metric_counts = np.zeros((n_rounds, n_metrics, n_arms))
    metric_sums = np.zeros((n_rounds, n_metrics, n_arms))
    if statistics:
        round_index, metric, arm, count, total = (list(column) for column in zip(*statistics))
        offset = np.asarray(round_index) - since
        metric_counts[offset, metric, arm] = count
        metric_sums[offset, metric, arm] = total
    observation_counts = np.zeros((n_rounds, n_arms), dtype=np.int64)
    unit_counts = np.zeros((n_rounds, n_arms), dtype=np.int64)
    late_counts = np.zeros(n_rounds, dtype=np.int64)
    if counts:
        round_index, arm, observations, units, late = (list(column) for column in zip(*counts))
        offset = np.asarray(round_index) - since
        observation_counts[offset, arm] = observations
        unit_counts[offset, arm] = units
        np.add.at(late_counts, offset, late)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(metric_counts > 0, metric_sums / metric_counts, np.nan)
    entries = []
    for round_row in round_rows:
        position = round_row.index - since
        summary = round_row.summary or {}
        best_single = summary.get("best_single")
        entries.append({
            "index": round_row.index,
            "started_at": iso(round_row.started_at),
            "ends_at": iso(round_row.ends_at),
            "closed_at": iso(round_row.closed_at),
            "applied_at": iso(round_row.applied_at),
            "probabilities": round_row.probabilities,
            "deployed": round_row.deployed,
            "counts": observation_counts[position].tolist(),
            "units": unit_counts[position].tolist(),
            "late_observations": int(late_counts[position]),
            "means": {
                metric: [None if not np.isfinite(value) else float(value) for value in means[position, m]]
                for m, metric in enumerate(snapshot.metrics)
            },
            "objective": summary.get("objective"),
            "objective_deployed": summary.get("objective_deployed"),
            "best_mixture": summary.get("best_mixture"),
            "best_single": None if best_single is None else {
                "arm": snapshot.arm_names[best_single["arm_index"]], "value": best_single["value"]},
            "regret": summary.get("regret"),
            "guardrails": summary.get("guardrails"),
        })
    return jsonify({"rounds": entries})
