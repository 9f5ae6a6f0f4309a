"""Statistics ingestion: batches of pre-aggregated cells, applied exactly once, all or nothing.

A stream or batch job that already aggregates its events sends per (round, arm, metric) cells
(``count``, ``sum``, ``sum_of_squares``) and per (round, arm) distinct ``units`` under a client-chosen
``batch_id`` (``POST .../statistics``). One request is one transaction (:func:`ingest_statistics`):

1. every cell and units entry is checked (known arms and metrics, a round that has started, one entry
   per key, numbers the schema accepts: ``service.schemas.StatisticsCell``); any problem rejects the
   whole batch with a 422 listing each offending item;
2. under the share lock on the experiment's row (``store.lock_for_ingestion``): a round whose ids were
   pruned by retention is refused (409: the batch could no longer be de-duplicated); the batch id is
   looked up: seen with the same content hash -> a duplicate, nothing written; seen with another hash
   -> 409 naming the id; new -> recorded with its hash, and its cells **added** to the round
   statistics exactly as observations of the same round are (``store.add_statistics``: the same
   ``round_statistics`` rows, and ``late_statistics`` for a round whose update ran), its units and
   observation counts to ``arm_round_counts``.

Two concurrent requests with one new id: on PostgreSQL the second insert of the id waits for the first
transaction and then finds the id (``store.insert_statistics_batch``); SQLite runs writers one at a time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .. import events, store
from ..cache import ExperimentCache, Snapshot
from ..errors import ApiError, problems_error
from ..models import utcnow
from ..schemas import (StatisticsBatch, parse_json, round_not_started_message, statistics_name_problems,
                       unknown_arm_message, unknown_metric_message)
from ..store import UnitOfWork
from .ingestion import open_experiment, pruned_error, segment_position, segment_problem, stopped_error


@dataclass(frozen=True)
class StatisticsResult:
    """What a statistics request did: ``duplicate`` (the batch id was applied before, with the same
    content: nothing was written), and for a new batch the ``cells`` and ``units`` entries added and
    the ``late_cells`` among them (rounds whose update had run)."""

    batch_id: str
    duplicate: bool
    cells: int
    units: int
    late_cells: int


def ingest_body(uow: UnitOfWork, name: str, body: bytes) -> StatisticsResult:
    """``POST .../statistics``: the body's bytes for experiment ``name`` applied once. 404 or 409 about
    the experiment before the body is looked at (``ingestion.open_experiment``), then the bytes
    validated into a :class:`~service.schemas.StatisticsBatch` and :func:`ingest_statistics`."""
    snapshot = open_experiment(uow, name)
    batch = parse_json(StatisticsBatch, body, also_check=lambda data: name_problems(uow, name, data))
    return ingest_statistics(uow, snapshot, batch)


def name_problems(uow: UnitOfWork, name: str, data: Any) -> list[tuple[tuple[Any, ...], str]]:
    """Unknown names and future rounds of a body that failed validation, for the same 422 as its type
    errors (``schemas.parse_json``'s ``also_check``)."""
    fresh = uow.cache.get(name, fresh=True)
    return statistics_name_problems(data, fresh.metrics, fresh.arm_names, fresh.round_index)


def content_hash(cells: list[tuple], units: list[tuple[int, int, int]]) -> str:
    """SHA-256 (hex) of a batch's content as :func:`resolve` gives it (sorted by key, sums as floats):
    independent of the order of the entries and of how a number was written (``2`` and ``2.0`` are the
    same sum). ``repr`` of a float is the shortest text that reads back as the same double, so equal
    content gives equal text; it is several times cheaper than JSON for 5,000 cells."""
    return hashlib.sha256(repr((cells, units)).encode()).hexdigest()


def resolve(cache: ExperimentCache, snapshot: Snapshot, batch: StatisticsBatch
            ) -> tuple[list[tuple], list[tuple], list[tuple[int, int, int]]]:
    """The batch as positions: cells ``(round, arm, metric, count, sum, sum_of_squares)`` sorted by key,
    the same cells per segment ``(round, segment, arm, metric, count, sum, sum_of_squares)`` sorted by
    key (what is stored: every transaction upserts rows in one order), and units ``(round, arm, units)``
    sorted by key.

    Unsegmented experiments: every cell is in segment 0. Segmented experiments: every cell names its
    segment as an observation does (``ingestion.segment_problem``), and the first cells are the sums
    over segments (what the arm round counts read; the content hash reads the first cells of an
    unsegmented batch and the per-segment ones of a segmented batch, as before migration 0017, so that a
    batch id applied before it is still recognised).

    Every problem (unknown arm, metric or segment, a round that has not started, a second entry for a
    key) is reported in one 422, in body order."""
    problems: list[tuple[int, int, str, str]] = []  # (field order, position, location, message)
    cells: list[tuple] = []
    by_segment: list[tuple] = []
    seen_cells: dict[tuple, int] = {}
    for position, cell in enumerate(batch.cells):
        where = f"cells[{position}]"
        arm = snapshot.arm_positions.get(cell.arm)
        metric = snapshot.metric_positions.get(cell.metric)
        problem = segment_problem(snapshot, cell.segment)
        if problem is not None:
            problems.append((0, position, f"{where}.segment", problem))
        if cell.round > snapshot.round_index:
            problems.append((0, position, f"{where}.round", round_not_started_message(cell.round, snapshot.round_index)))
        if arm is None:
            problems.append((0, position, f"{where}.arm", unknown_arm_message(cell.arm)))
        if metric is None:
            problems.append((0, position, f"{where}.metric", unknown_metric_message(cell.metric, snapshot.metrics)))
        key = (cell.round, cell.arm, cell.metric) if not snapshot.segmented else (
            cell.round, cell.arm, cell.metric, cell.segment)
        first = seen_cells.setdefault(key, position)
        if first != position:
            what = "round, arm and metric" if not snapshot.segmented else "round, arm, metric and segment"
            problems.append((0, position, where, f"Duplicate {what} (first at cells[{first}]); a batch holds "
                                                 f"one cell per {what}."))
        if arm is not None and metric is not None:
            cells.append((cell.round, arm, metric, cell.count, float(cell.sum), float(cell.sum_of_squares)))
            if snapshot.segmented and problem is None and cell.round <= snapshot.round_index:
                segment = segment_position(snapshot, cell.segment)
                if snapshot.segment_open and segment >= len(cache.round_segment_probabilities(snapshot, cell.round)):
                    segment = 0  # the value had no mixture of its own in that round: the long tail's
                by_segment.append((cell.round, segment, arm, metric, cell.count, float(cell.sum),
                                   float(cell.sum_of_squares)))
    units: list[tuple[int, int, int]] = []
    seen_units: dict[tuple[int, str], int] = {}
    for position, entry in enumerate(batch.units):
        where = f"units[{position}]"
        arm = snapshot.arm_positions.get(entry.arm)
        if entry.round > snapshot.round_index:
            problems.append((1, position, f"{where}.round", round_not_started_message(entry.round, snapshot.round_index)))
        if arm is None:
            problems.append((1, position, f"{where}.arm", unknown_arm_message(entry.arm)))
        first = seen_units.setdefault((entry.round, entry.arm), position)
        if first != position:
            problems.append((1, position, where, f"Duplicate round and arm (first at units[{first}]); a batch "
                                                 "holds one units entry per round and arm."))
        if arm is not None:
            units.append((entry.round, arm, entry.units))
    if problems:
        problems.sort(key=lambda problem: problem[:2])  # stable: within an item, in the order checked
        raise problems_error([{"location": location, "message": message} for _, _, location, message in problems])
    if not snapshot.segmented:
        cells.sort()
        return cells, [(round_index, 0, *rest) for round_index, *rest in cells], sorted(units)
    summed: dict[tuple, list] = {}
    for round_index, segment, arm, metric, count, total, total_of_squares in by_segment:
        sums = summed.setdefault((round_index, segment, arm, metric), [0, 0.0, 0.0])
        sums[0] += count
        sums[1] += total
        sums[2] += total_of_squares
    aggregate: dict[tuple, list] = {}
    for round_index, arm, metric, count, total, total_of_squares in cells:
        sums = aggregate.setdefault((round_index, arm, metric), [0, 0.0, 0.0])
        sums[0] += count
        sums[1] += total
        sums[2] += total_of_squares
    return (sorted((*key, *sums) for key, sums in aggregate.items()),
            [(*key, *sums) for key, sums in sorted(summed.items())], sorted(units))


def _conflicting_batch(batch_id: str) -> ApiError:
    return ApiError(409, "conflict",
                    f"Statistics batch {batch_id!r} was already applied with different content; a batch id "
                    "names one batch: send new statistics under a new id.", {"batch_id": batch_id})


def ingest_statistics(uow: UnitOfWork, snapshot: Snapshot, batch: StatisticsBatch) -> StatisticsResult:
    """Validate ``batch`` against the experiment of ``snapshot`` (``ingestion.open_experiment``) and
    apply it once (see the module docstring)."""
    last_round = max([cell.round for cell in batch.cells] + [entry.round for entry in batch.units])
    if last_round > snapshot.round_index:
        snapshot = uow.cache.get(snapshot.name, fresh=True)  # another worker may have started a newer round
    cells, segment_cells, units = resolve(uow.cache, snapshot, batch)
    first_round = min([cell[0] for cell in cells] + [entry[0] for entry in units])
    digest = content_hash(segment_cells if snapshot.segmented else cells, units)
    with uow.write() as session:
        row = store.lock_for_ingestion(session, snapshot.id)
        if row is None:  # deleted since this process cached the snapshot
            uow.cache.forget(snapshot.name)
            raise ApiError(404, "not_found", f"There is no experiment named {snapshot.name!r}.")
        if row.status == "stopped":
            raise stopped_error(snapshot.name)
        if first_round < row.pruned_rounds:
            raise pruned_error(first_round, row.pruned_rounds, "a statistics batch")
        stored = store.statistics_batch_hash(session, snapshot.id, batch.batch_id)
        if stored is None and not store.insert_statistics_batch(
                uow.database, session, snapshot.id, batch.batch_id, digest, (first_round, last_round), len(cells),
                utcnow()):
            stored = store.statistics_batch_hash(session, snapshot.id, batch.batch_id)  # committed meanwhile
        if stored is not None:
            if stored != digest:
                raise _conflicting_batch(batch.batch_id)
            return StatisticsResult(batch.batch_id, duplicate=True, cells=0, units=0, late_cells=0)
        connection = session.connection()
        store.add_statistics(connection, snapshot.id, segment_cells, row.applied_rounds)
        counts = arm_round_counts(cells, units, row.applied_rounds)
        store.add_arm_round_counts(connection, snapshot.id, counts)
    late_cells = sum(1 for cell in cells if cell[0] < row.applied_rounds)
    arm_counts: dict[int, int] = {}
    for _, arm, observations, _, _ in counts:
        arm_counts[arm] = arm_counts.get(arm, 0) + observations
    events.observed.send(snapshot, accepted=sum(arm_counts.values()), duplicates=0, arm_counts=arm_counts)
    return StatisticsResult(batch.batch_id, duplicate=False, cells=len(cells), units=len(units), late_cells=late_cells)


def arm_round_counts(cells: list[tuple], units: list[tuple[int, int, int]], applied_rounds: int
                     ) -> list[tuple[int, int, int, int, int]]:
    """``(round, arm, observations, units, late_observations)`` per (round, arm) of a batch, sorted.

    A cell counts values of one metric; an observation carries one or more metrics, so the observations
    a batch stands for in a (round, arm) are taken as its largest cell count there (exact when every
    observation has every metric, a lower bound otherwise). Late when the round's update has run."""
    observations: dict[tuple[int, int], int] = {}
    for round_index, arm, _, count, _, _ in cells:
        observations[(round_index, arm)] = max(observations.get((round_index, arm), 0), count)
    distinct = {(round_index, arm): n for round_index, arm, n in units}
    return [(round_index, arm, observations.get((round_index, arm), 0), distinct.get((round_index, arm), 0),
             observations.get((round_index, arm), 0) if round_index < applied_rounds else 0)
            for round_index, arm in sorted(observations.keys() | distinct.keys())]
