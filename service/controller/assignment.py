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
from ..errors import invalid, problems_error
from ..exposures import record_exposures
from .ingestion import segment_problem


def assign_one(name: str, unit: str, segment: str | None = None) -> tuple[Snapshot, bool, int, float]:
    """The snapshot served, whether it is stale (the database is unavailable: ``ExperimentCache.serve``),
    the arm position of ``unit`` and its propensity. A segmented experiment serves the mixture of the
    unit's ``segment`` (422 when it is missing or unknown, or given to an unsegmented experiment)."""
    snapshot, stale = get_cache().serve(name)
    problem = segment_problem(snapshot, segment)
    if problem is not None:
        raise invalid("segment", problem)
    if segment is None:
        arm = choose_arm(snapshot.serving_cumulative, snapshot.hasher(unit))
        probability = float(snapshot.serving[arm])
    else:
        position = snapshot.segment_positions[segment]
        arm = choose_arm(snapshot.segment_serving_cumulative[position], snapshot.hasher(unit))
        probability = float(snapshot.segment_serving[position, arm])
    events.assigned.send(snapshot, arms=[arm])
    record_exposures(snapshot, [unit], [arm], None if segment is None else [segment])
    return snapshot, stale, arm, probability


def assign_many(name: str, units: list[str], segments: list[str] | None = None
                ) -> tuple[Snapshot, bool, np.ndarray, np.ndarray]:
    """The snapshot served, whether it is stale, and the arm position and propensity of each of
    ``units``, shapes (N,); a segmented experiment serves each unit its segment's mixture (``segments``,
    one per unit; a 422 naming every missing or unknown one)."""
    snapshot, stale = get_cache().serve(name)
    u = buckets(snapshot.seed, units, snapshot.round_index)
    if not snapshot.segmented and segments is None:
        arms = choose_arms(snapshot.serving, u)
        probabilities = snapshot.serving[arms]
    else:
        given = segments if segments is not None else [None] * len(units)
        problems = []
        for position, segment in enumerate(given):
            problem = segment_problem(snapshot, segment)
            if problem is not None:
                problems.append({"location": f"segments[{position}]", "message": problem})
        if problems:
            raise problems_error(problems)
        positions = np.fromiter((snapshot.segment_positions[segment] for segment in given), dtype=np.int64,
                                count=len(given))
        arms = np.empty(len(units), dtype=np.int64)
        for position in np.unique(positions).tolist():
            members = positions == position
            arms[members] = choose_arms(snapshot.segment_serving[position], u[members])
        probabilities = snapshot.segment_serving[positions, arms]
    events.assigned.send(snapshot, arms=arms)
    record_exposures(snapshot, units, arms, segments if snapshot.segmented else None)
    return snapshot, stale, arms, probabilities
