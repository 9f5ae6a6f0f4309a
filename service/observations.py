"""Observation ingestion: exactly-once, all-or-nothing, aggregated into sufficient statistics.

One request is one transaction:

1. every observation is validated (known metrics and arm, a round that has started, an arm that
   matches the unit's sticky assignment); any problem rejects the whole batch with a 422;
2. the ids are inserted with ``ON CONFLICT DO NOTHING RETURNING``: the returned ids are the new ones,
   everything else is a duplicate (of this batch or of any earlier request). A cheaper plain
   ``INSERT`` is tried first: it succeeds whenever every id is new; if one is not (a client's
   retry), that transaction is rolled back and the request runs again with the checked insert;
3. only the new observations are summed per (round, arm, metric) and added with atomic upserts
   (``count = count + excluded.count``), rows sorted so concurrent writers lock them in one order.

Observations for a round whose update already ran are kept: they are added to that round's
statistics and to ``late_statistics``, enter the pooled statistics of the next update, and are
counted as late.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlalchemy as sa
from flask import Blueprint, jsonify

from pasto.hashing import buckets, choose_arms

from . import events
from .auth import require_role
from .cache import Snapshot, get_cache
from .db import Database, KeysExist, get_db
from .errors import ApiError, problems_error
from .models import ArmRoundCount, Experiment, LateStatistic, ObservationId, RoundStatistic, RoundUnit
from .schemas import Observation, ObservationBatch, json_bytes, observation_name_problems, parse_json

bp = Blueprint("observations", __name__, url_prefix="/api/v1/experiments")


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int
    arm_counts: dict[int, int]


@bp.post("/<name>/observations")
@require_role("ingest")
def ingest_observations(name: str):
    body = json_bytes()
    cache = get_cache()
    snapshot = cache.get(name, check=False)
    if snapshot.status == "stopped":  # maybe stale: ingest() checks again under the row lock
        raise _stopped(name)
    batch = parse_json(ObservationBatch, body, also_check=lambda data: _name_problems(name, data)).observations
    if max(observation.round for observation in batch) > snapshot.round_index:
        snapshot = cache.get(name, fresh=True)  # another worker may have started a newer round
    arm_indices = resolve_arms(snapshot, batch)
    result = ingest(get_db(), snapshot, batch, arm_indices)
    events.observed.send(snapshot, accepted=result.accepted, duplicates=result.duplicates,
                         arm_counts=result.arm_counts)
    response = jsonify({"accepted": result.accepted, "duplicates": result.duplicates})
    response.status_code = 202
    return response


def _name_problems(name: str, data: Any) -> list[tuple[tuple[Any, ...], str]]:
    """Unknown names and future rounds of a batch that failed validation, for the same 422 as its type errors."""
    fresh = get_cache().get(name, fresh=True)  # only on this error path: the current round, however new
    return observation_name_problems(data, fresh.metrics, fresh.arm_names, fresh.round_index)


def _stopped(name: str) -> ApiError:
    return ApiError(409, "conflict", f"Experiment {name!r} is stopped; it no longer accepts observations.")


def resolve_arms(snapshot: Snapshot, batch: list[Observation]) -> np.ndarray:
    """Check every observation against the experiment and return its arm position, shape (N,).

    The arm is the unit's sticky assignment in the observation's round; a given ``arm`` must agree.
    Every problem in the batch is reported (a 422 whose details list them in body order).
    """
    problems: list[tuple[int, str, str]] = []
    for position, observation in enumerate(batch):
        if observation.round > snapshot.round_index:
            problems.append((position, f"observations[{position}].round",
                             f"Round {observation.round} has not started; the current round is "
                             f"{snapshot.round_index}."))
        for metric in observation.values:
            if metric not in snapshot.metric_positions:
                problems.append((position, f"observations[{position}].values.{metric}",
                                 f"Unknown metric {metric!r}; the metrics are {list(snapshot.metrics)}."))
        if observation.arm is not None and observation.arm not in snapshot.arm_positions:
            problems.append((position, f"observations[{position}].arm", f"Unknown arm {observation.arm!r}."))
    rounds = np.fromiter((observation.round for observation in batch), dtype=np.int64, count=len(batch))
    arms = np.full(len(batch), -1, dtype=np.int64)  # -1: a round that has not started has no assignment
    cache = get_cache()
    for round_index in np.unique(rounds[rounds <= snapshot.round_index]).tolist():
        members = np.flatnonzero(rounds == round_index)
        units = [batch[i].unit for i in members.tolist()]
        probabilities = cache.round_probabilities(snapshot, round_index)
        arms[members] = choose_arms(probabilities, buckets(snapshot.seed, units, round_index))
    for position, observation in enumerate(batch):
        given = snapshot.arm_positions.get(observation.arm) if observation.arm is not None else None
        if given is not None and arms[position] >= 0 and given != arms[position]:
            sticky = snapshot.arm_names[arms[position]]
            problems.append((position, f"observations[{position}].arm",
                             f"Unit {observation.unit!r} is assigned to arm {sticky!r} in round {observation.round}, "
                             f"not {observation.arm!r}."))
    if problems:
        problems.sort(key=lambda problem: problem[0])  # stable: within an item, in the order checked
        raise problems_error([{"location": location, "message": message} for _, location, message in problems])
    return arms


def ingest(database: Database, snapshot: Snapshot, batch: list[Observation], arm_indices: np.ndarray) -> IngestResult:
    """Store the new observations of ``batch`` in one transaction and report what was new."""
    try:
        return _store(database, snapshot, batch, arm_indices, ids_expected_new=True)
    except KeysExist:  # a resent id (or one a concurrent request committed first): nothing was stored
        return _store(database, snapshot, batch, arm_indices, ids_expected_new=False)


def _store(database: Database, snapshot: Snapshot, batch: list[Observation], arm_indices: np.ndarray,
           ids_expected_new: bool) -> IngestResult:
    first_of_id: dict[str, int] = {}
    for position, observation in enumerate(batch):
        first_of_id.setdefault(observation.id, position)
    arms = arm_indices.tolist()
    experiment_id = snapshot.id
    ids = ObservationId.__table__
    with database.write() as session:
        connection = session.connection()
        # Shares the row lock with other ingestion requests and excludes a concurrent round close, so
        # "late" is decided against the rounds as they are when this transaction commits.
        row = connection.execute(
            sa.select(Experiment.status, Experiment.applied_rounds)
            .where(Experiment.id == experiment_id)
            .with_for_update(read=True)
        ).one()
        if row.status == "stopped":
            raise _stopped(snapshot.name)
        # Sorted ids: concurrent batches sharing ids wait on each other in one order, never in a cycle.
        inserted = database.insert_new(
            connection, ids, ("experiment_id", "client_id", "round_index", "arm_index"),
            [(experiment_id, client_id, batch[position].round, arms[position])
             for client_id, position in sorted(first_of_id.items())],
            returning=("client_id",), expect_new=ids_expected_new,
        )
        new_positions = sorted(first_of_id[client_id] for (client_id,) in inserted)
        arm_counts: Counter[int] = Counter()
        if new_positions:
            _add_statistics(connection, database, snapshot, batch, arms, new_positions, row.applied_rounds)
            arm_counts = _add_counts(connection, database, experiment_id, batch, arms, new_positions,
                                     row.applied_rounds)
    return IngestResult(accepted=len(new_positions), duplicates=len(batch) - len(new_positions),
                        arm_counts=dict(arm_counts))


def _add_statistics(connection, database: Database, snapshot: Snapshot, batch, arms: list[int],
                    positions: list[int], applied_rounds: int) -> None:
    n_arms, n_metrics = snapshot.n_arms, len(snapshot.metrics)
    metric_positions = snapshot.metric_positions
    keys: list[int] = []
    values: list[float] = []
    for position in positions:
        observation = batch[position]
        base = (observation.round * n_arms + arms[position]) * n_metrics
        for metric, value in observation.values.items():
            keys.append(base + metric_positions[metric])
            values.append(value)
    # One integer key per (round, arm, metric); np.unique sorts them, so every transaction upserts
    # (and locks) rows in the same order.
    unique_keys, group = np.unique(np.asarray(keys, dtype=np.int64), return_inverse=True)
    value_array = np.asarray(values, dtype=np.float64)
    counts = np.bincount(group, minlength=unique_keys.size)
    sums = np.bincount(group, weights=value_array, minlength=unique_keys.size)
    sums_of_squares = np.bincount(group, weights=value_array * value_array, minlength=unique_keys.size)
    add_statistics(
        connection, database, snapshot.id,
        [(key // (n_arms * n_metrics), key // n_metrics % n_arms, key % n_metrics, count, total, total_of_squares)
         for key, count, total, total_of_squares in zip(
             unique_keys.tolist(), counts.tolist(), sums.tolist(), sums_of_squares.tolist())],
        applied_rounds,
    )


def add_statistics(connection, database: Database, experiment_id: int, cells: list[tuple], applied_rounds: int) -> None:
    """Add ``cells`` (``(round_index, arm_index, metric_index, count, sum, sum_of_squares)``, one per
    key, sorted by key) to the round statistics, and the cells of rounds already applied (late data)
    to ``late_statistics`` too, where the next round update finds them (``service.rounds``).

    ``applied_rounds`` must have been read under the share lock on the experiment's row that this
    transaction holds: a round update, which empties ``late_statistics``, waits for it.
    """
    database.add_rows(
        connection, RoundStatistic.__table__, ("experiment_id", "round_index", "arm_index", "metric_index"),
        ("count", "sum", "sum_of_squares"), [(experiment_id, *cell) for cell in cells],
    )
    late: dict[tuple[int, int], list] = {}
    for round_index, arm, metric, count, total, total_of_squares in cells:
        if round_index < applied_rounds:
            sums = late.setdefault((metric, arm), [0, 0.0, 0.0])
            sums[0] += count
            sums[1] += total
            sums[2] += total_of_squares
    if late:
        database.add_rows(
            connection, LateStatistic.__table__, ("experiment_id", "metric_index", "arm_index"),
            ("count", "sum", "sum_of_squares"),
            [(experiment_id, metric, arm, *sums) for (metric, arm), sums in sorted(late.items())],
        )


def _add_counts(connection, database: Database, experiment_id: int, batch, arms: list[int], positions: list[int],
                applied_rounds: int) -> Counter[int]:
    observations: Counter[tuple[int, int]] = Counter()
    late: Counter[tuple[int, int]] = Counter()
    unit_arm: dict[tuple[int, str], int] = {}
    for position in positions:
        observation = batch[position]
        key = (observation.round, arms[position])
        observations[key] += 1
        if observation.round < applied_rounds:
            late[key] += 1
        unit_arm.setdefault((observation.round, observation.unit), key[1])
    new_units = Counter(database.insert_new(
        connection, RoundUnit.__table__, ("experiment_id", "round_index", "unit", "arm_index"),
        [(experiment_id, round_index, unit, arm) for (round_index, unit), arm in sorted(unit_arm.items())],
        returning=("round_index", "arm_index"),
    ))
    database.add_rows(
        connection, ArmRoundCount.__table__, ("experiment_id", "round_index", "arm_index"),
        ("observations", "units", "late_observations"),
        [(experiment_id, key[0], key[1], count, new_units.get(key, 0), late.get(key, 0))
         for key, count in sorted(observations.items())],
    )
    arm_counts: Counter[int] = Counter()
    for (_, arm), count in observations.items():
        arm_counts[arm] += count
    return arm_counts
