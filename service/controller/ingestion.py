"""Observation ingestion: exactly-once, all-or-nothing, aggregated into sufficient statistics.

One request is one transaction (:func:`ingest`):

1. every observation is validated (known metrics and arm, a round that has started, an arm that
   matches the unit's sticky assignment); any problem rejects the whole batch with a 422;
2. the ids are inserted with ``ON CONFLICT DO NOTHING RETURNING``: the returned ids are the new ones,
   everything else is a duplicate (of this batch or of any earlier request). A cheaper plain
   ``INSERT`` is tried first: it succeeds whenever every id is new; if one is not (a client's
   retry), that transaction is rolled back and the request runs again with the checked insert;
3. only the new observations are summed per (round, arm, metric) by
   ``pasto.estimators.Statistics.from_observations`` and added with atomic upserts
   (``count = count + excluded.count``), rows sorted so concurrent writers lock them in one order.

Observations for a round whose update already ran are kept: they are added to that round's
statistics and to ``late_statistics``, enter the pooled statistics of the next update, and are
counted as late. Observations for a round whose ids retention has pruned (``experiments.pruned_rounds``,
``service.controller.retention``) are refused with a 409: their ids could no longer be de-duplicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pasto.estimators import Statistics
from pasto.hashing import buckets, choose_arms

from .. import events, store
from ..cache import ExperimentCache, Snapshot
from ..errors import ApiError, problems_error
from ..schemas import Observation, ObservationBatch, observation_name_problems, parse_json
from ..store import UnitOfWork


@dataclass(frozen=True)
class IngestResult:
    accepted: int
    duplicates: int
    arm_counts: dict[int, int]


def stopped_error(name: str) -> ApiError:
    return ApiError(409, "conflict", f"Experiment {name!r} is stopped; it no longer accepts observations.")


def pruned_error(round_index: int, pruned_rounds: int, what: str) -> ApiError:
    """409 for data of a round whose observation ids were deleted by retention."""
    return ApiError(409, "round_pruned",
                    f"Round {round_index} is older than the retention window: the ids of rounds below "
                    f"{pruned_rounds} were pruned, so {what} for it could no longer be de-duplicated and is refused.",
                    {"round": round_index, "pruned_rounds": pruned_rounds})


def ingest_body(uow: UnitOfWork, name: str, body: bytes) -> IngestResult:
    """``POST .../observations``: the body's bytes for experiment ``name`` ingested. 404 or 409 about
    the experiment before the body is looked at (:func:`open_experiment`); the bytes validated straight
    into :class:`~service.schemas.ObservationBatch` (``schemas.parse_json``: no intermediate Python
    objects; a 422 lists type errors, unknown names and future rounds together); then :func:`ingest`."""
    snapshot = open_experiment(uow, name)
    batch = parse_json(ObservationBatch, body, also_check=lambda data: name_problems(uow, name, data))
    return ingest(uow, snapshot, batch.observations)


def open_experiment(uow: UnitOfWork, name: str) -> Snapshot:
    """The experiment observations are for: 404 when there is none, 409 when it is stopped, before the
    body is looked at. The cached snapshot, not checked against the database (see ``ExperimentCache.get``)."""
    snapshot = uow.cache.get(name, check=False)
    if snapshot.status == "stopped":  # maybe stale: checked again under the row lock
        raise stopped_error(name)
    return snapshot


def name_problems(uow: UnitOfWork, name: str, data: Any) -> list[tuple[tuple[Any, ...], str]]:
    """Unknown names and future rounds of a batch that failed validation, reported in the same 422 as
    its type errors (``schemas.parse_json``'s ``also_check``)."""
    fresh = uow.cache.get(name, fresh=True)  # only on this error path: the current round, however new
    return observation_name_problems(data, fresh.metrics, fresh.arm_names, fresh.round_index)


def ingest(uow: UnitOfWork, snapshot: Snapshot, batch: list[Observation]) -> IngestResult:
    """Validate ``batch`` against the experiment of ``snapshot`` (:func:`open_experiment`) and store
    its new observations."""
    cache = uow.cache
    if max(observation.round for observation in batch) > snapshot.round_index:
        snapshot = cache.get(snapshot.name, fresh=True)  # another worker may have started a newer round
    segments: np.ndarray | None = None if not snapshot.segmented else np.full(len(batch), -1, dtype=np.int64)
    arms = resolve_arms(cache, snapshot, batch, segments)
    try:
        result = _write_batch(uow, snapshot, batch, arms, ids_expected_new=True, segments=segments)
    except store.KeysExist:  # a resent id (or one a concurrent request committed first): nothing was stored
        result = _write_batch(uow, snapshot, batch, arms, ids_expected_new=False, segments=segments)
    events.observed.send(snapshot, accepted=result.accepted, duplicates=result.duplicates,
                         arm_counts=result.arm_counts)
    return result


def resolve_arms(cache: ExperimentCache, snapshot: Snapshot, batch: list[Observation],
                 segment_positions: np.ndarray | None = None) -> np.ndarray:
    """Check every observation against the experiment and return its arm position, shape (N,).

    Segmented experiments: ``segment_positions`` (N,) receives each observation's segment position in
    its round (an open set's value without a mixture of its own in that round: 0, the long tail).

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
    segments = resolve_segments(snapshot, batch, problems)
    rounds = np.fromiter((observation.round for observation in batch), dtype=np.int64, count=len(batch))
    arms = np.full(len(batch), -1, dtype=np.int64)  # -1: a round that has not started has no assignment
    for round_index in np.unique(rounds[rounds <= snapshot.round_index]).tolist():
        members = np.flatnonzero(rounds == round_index)
        if segments is None:
            units = [batch[i].unit for i in members.tolist()]
            probabilities = cache.round_probabilities(snapshot, round_index)
            arms[members] = choose_arms(probabilities, buckets(snapshot.seed, units, round_index))
            continue
        # Segmented: the unit's sticky arm under its segment's mixture of that round (an open set's
        # value that got its mixture after that round was served the long tail's, segment 0).
        per_segment = cache.round_segment_probabilities(snapshot, round_index)
        segments[members] = np.where(segments[members] >= len(per_segment), 0, segments[members])
        for segment in np.unique(segments[members]).tolist():
            if segment < 0:
                continue  # an unknown or missing segment, reported above
            group = members[segments[members] == segment]
            units = [batch[i].unit for i in group.tolist()]
            arms[group] = choose_arms(per_segment[segment], buckets(snapshot.seed, units, round_index))
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
    if segment_positions is not None:
        segment_positions[:] = segments
    return arms


def segment_problem(snapshot: Snapshot, segment: str | None) -> str | None:
    """Why ``segment`` cannot be used with the experiment of ``snapshot`` (None: it can)."""
    if not snapshot.segmented:
        if segment is not None:
            return f"Experiment {snapshot.name!r} has no segments; send no segment."
        return None
    if snapshot.segment_open:
        return None  # any value (or none): those without a mixture of their own get the long tail's
    if segment is None:
        return (f"Experiment {snapshot.name!r} is segmented: give the unit's segment, one of "
                f"{list(snapshot.segment_names)}.")
    if segment not in snapshot.segment_positions:
        return f"Unknown segment {segment!r}; the segments are {list(snapshot.segment_names)}."
    return None


def resolve_segments(snapshot: Snapshot, batch: list[Observation],
                     problems: list[tuple[int, str, str]]) -> np.ndarray | None:
    """Segment positions of the observations, shape (N,) (-1 where refused; None: unsegmented experiment),
    problems appended to ``problems``."""
    positions = np.full(len(batch), -1, dtype=np.int64)
    for position, observation in enumerate(batch):
        problem = segment_problem(snapshot, observation.segment)
        if problem is not None:
            problems.append((position, f"observations[{position}].segment", problem))
        elif snapshot.segmented:
            positions[position] = segment_position(snapshot, observation.segment)
    return positions if snapshot.segmented else None


def segment_position(snapshot: Snapshot, segment: str | None) -> int:
    """The position of ``segment`` among the experiment's segments now (checked by :func:`segment_problem`);
    in an open set, 0 (the long tail) for a value without a mixture of its own and for no value."""
    if snapshot.segment_open:
        return snapshot.segment_positions.get(segment, 0)
    return snapshot.segment_positions[segment]


def _write_batch(uow: UnitOfWork, snapshot: Snapshot, batch: list[Observation], arm_indices: np.ndarray,
                 ids_expected_new: bool, segments: np.ndarray | None = None) -> IngestResult:
    first_of_id: dict[str, int] = {}
    for position, observation in enumerate(batch):
        first_of_id.setdefault(observation.id, position)
    arms = arm_indices.tolist()
    with uow.write() as session:
        row = store.lock_for_ingestion(session, snapshot.id)
        if row is None:  # deleted since this process cached the snapshot
            uow.cache.forget(snapshot.name)
            raise ApiError(404, "not_found", f"There is no experiment named {snapshot.name!r}.")
        if row.status == "stopped":
            raise stopped_error(snapshot.name)
        oldest = min(batch[position].round for position in first_of_id.values())
        if oldest < row.pruned_rounds:
            raise pruned_error(oldest, row.pruned_rounds, "an observation")
        inserted = store.insert_observation_ids(
            session, snapshot.id,
            [(client_id, batch[position].round, arms[position]) for client_id, position in sorted(first_of_id.items())],
            expect_new=ids_expected_new,
        )
        new_positions = sorted(first_of_id[client_id] for client_id in inserted)
        arm_counts: dict[int, int] = {}
        if new_positions:
            connection = session.connection()
            store.add_statistics(connection, snapshot.id,
                                 statistics_cells(snapshot, batch, arm_indices, new_positions, segments),
                                 row.applied_rounds)
            if snapshot.segmented and snapshot.segment_open:
                # Units of values without a mixture of their own: counted toward min_units.
                store.add_segment_value_units(connection, snapshot.id, sorted({
                    (batch[p].segment, batch[p].unit) for p in new_positions
                    if batch[p].segment is not None and batch[p].segment not in snapshot.segment_positions}))
            arm_counts = dict(store.add_units_and_counts(
                connection, snapshot.id, ((batch[p].round, batch[p].unit, arms[p]) for p in new_positions),
                row.applied_rounds))
    return IngestResult(accepted=len(new_positions), duplicates=len(batch) - len(new_positions),
                        arm_counts=arm_counts)


def statistics_cells(snapshot: Snapshot, batch: list[Observation], arms: np.ndarray, positions: list[int],
                     segment_positions: np.ndarray | None = None
                     ) -> list[tuple[int, int, int, int, int, float, float]]:
    """The sufficient statistics of ``batch[positions]`` as ``(round, segment, arm, metric, count, sum,
    sum_of_squares)`` rows, one per cell with data, sorted by (round, segment, arm, metric): every
    transaction upserts (and locks) rows in the same order. ``segment_positions`` (N,) are the
    observations' segments (:func:`resolve_segments`); None for an unsegmented experiment, whose
    observations are all in segment 0.

    Each (round, segment, arm) triple of the batch is one "arm" of ``Statistics.from_observations``,
    whose values matrix (N, M) holds nan where an observation lacks a metric.
    """
    n_arms, n_metrics = snapshot.n_arms, len(snapshot.metrics)
    n_segments = 1 if segment_positions is None else len(snapshot.segment_names)
    metric_positions = snapshot.metric_positions
    rows: list[int] = []
    columns: list[int] = []
    observed: list[float] = []
    for row, position in enumerate(positions):
        for metric, value in batch[position].values.items():
            rows.append(row)
            columns.append(metric_positions[metric])
            observed.append(value)
    values = np.full((len(positions), n_metrics), np.nan)
    values[rows, columns] = observed
    rounds = np.fromiter((batch[position].round for position in positions), dtype=np.int64, count=len(positions))
    keys = rounds * n_segments
    if segment_positions is not None:
        keys += segment_positions[positions]
    keys = keys * n_arms + arms[positions]
    triples, triple_of = np.unique(keys, return_inverse=True)  # sorted (round, segment, arm)
    statistics = Statistics.from_observations(triple_of, values, triples.size)  # (M, triples)
    triple, metric = np.nonzero(statistics.counts.T)  # triple-major: (round, segment, arm, metric) order
    key = triples[triple]
    return list(zip((key // (n_segments * n_arms)).tolist(), (key // n_arms % n_segments).tolist(),
                    (key % n_arms).tolist(), metric.tolist(),
                    statistics.counts.T[triple, metric].astype(np.int64).tolist(),
                    statistics.sums.T[triple, metric].tolist(), statistics.sums_of_squares.T[triple, metric].tolist()))
