"""Retention: the per-observation rows of old rounds are deleted, so storage stays bounded.

Exactly-once ingestion keeps a row per observation id (``observation_ids``), per distinct unit of a
round (``round_units``) and per statistics batch (``statistics_batches``). Those rows are only needed
to recognise a resend; the statistics they fed stay in ``round_statistics`` / ``arm_round_counts``
for ever. :func:`prune` (run by the scheduler on every tick) deletes them for the rounds whose update
ran more than ``PASTO_RETENTION_SECONDS`` ago:

1. in one short transaction, the experiment's ``pruned_rounds`` rises to cover those rounds (its row
   lock waits for ingestion in flight; later ingestion refuses data for a round below it with a 409,
   so nothing can be counted twice once its id is gone);
2. the rows of rounds below ``pruned_rounds`` are deleted in chunks of at most ``chunk_rows``, each its
   own transaction, at most ``max_chunks`` per call: a tick never holds long locks, and what is left
   is deleted by the next ticks (a crash between the two steps likewise leaves rows that the next tick
   deletes).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from .. import store
from ..store import UnitOfWork

#: Rows deleted per transaction.
CHUNK_ROWS = 5_000
#: Chunks per call of :func:`prune` (per scheduler tick, over every experiment).
MAX_CHUNKS = 40


@dataclass(frozen=True)
class PruneResult:
    """What one :func:`prune` call did: ``advanced`` maps experiment id to its new ``pruned_rounds``;
    ``deleted`` counts the rows deleted per table; ``finished`` is False when ``max_chunks`` stopped it
    with rows left to delete."""

    advanced: dict[int, int]
    deleted: dict[str, int]
    finished: bool


def prune(uow: UnitOfWork, now: datetime, retention_seconds: float | None, *, chunk_rows: int = CHUNK_ROWS,
          max_chunks: int = MAX_CHUNKS) -> PruneResult:
    """Advance every experiment's ``pruned_rounds`` to the rounds applied at or before
    ``now - retention_seconds`` and delete the per-observation rows of pruned rounds in bounded chunks.

    ``retention_seconds`` None keeps everything (nothing is done)."""
    advanced: dict[int, int] = {}
    deleted = {table.name: 0 for table, _ in store.PRUNED_TABLES}
    if retention_seconds is None:
        return PruneResult(advanced, deleted, True)
    cutoff = now - timedelta(seconds=retention_seconds)
    chunks = 0
    for experiment_id, pruned_rounds in store.experiments_to_prune(uow.database, ):
        with uow.read() as session:
            target = store.prunable_rounds(session, experiment_id, cutoff)
        if target > pruned_rounds:
            with uow.write() as session:
                if store.advance_pruned_rounds(session, experiment_id, target):
                    advanced[experiment_id] = target
            pruned_rounds = max(pruned_rounds, target)
        if pruned_rounds == 0:
            continue
        for table, round_column in store.PRUNED_TABLES:
            while True:
                if chunks >= max_chunks:
                    return PruneResult(advanced, deleted, False)
                chunks += 1
                with uow.write() as session:
                    count = store.delete_pruned_rows(session, table, round_column, experiment_id, pruned_rounds,
                                                     chunk_rows)
                deleted[table.name] += count
                if count < chunk_rows:
                    break
    return PruneResult(advanced, deleted, True)
