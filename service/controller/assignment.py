"""Assignment: which arm (parameter setting) a unit gets in the current round.

No database write happens here: the cached snapshot (one version read per request) gives the seed,
the round and the mixture, and ``pasto.hashing`` maps the unit to an arm, so the same unit gets the
same arm for the whole round in every process, and clients can assign locally with the same result.
"""

from __future__ import annotations

import numpy as np

from pasto.hashing import buckets, choose_arm, choose_arms

from .. import events
from ..cache import Snapshot, get_cache
from ..exposures import record_exposures


def assign_one(name: str, unit: str) -> tuple[Snapshot, bool, int]:
    """The snapshot served, whether it is stale (the database is unavailable: ``ExperimentCache.serve``)
    and the arm position of ``unit``."""
    snapshot, stale = get_cache().serve(name)
    arm = choose_arm(snapshot.serving_cumulative, snapshot.hasher(unit))
    events.assigned.send(snapshot, arms=[arm])
    record_exposures(snapshot, [unit], [arm])
    return snapshot, stale, arm


def assign_many(name: str, units: list[str]) -> tuple[Snapshot, bool, np.ndarray]:
    """The snapshot served, whether it is stale, and the arm position of each of ``units``, shape (N,)."""
    snapshot, stale = get_cache().serve(name)
    arms = choose_arms(snapshot.serving, buckets(snapshot.seed, units, snapshot.round_index))
    events.assigned.send(snapshot, arms=arms)
    record_exposures(snapshot, units, arms)
    return snapshot, stale, arms
