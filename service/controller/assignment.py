"""Assignment: which arm (parameter setting) a unit gets in the current round.

No database write happens here: the cached snapshot (one version read per request) gives the seed,
the round and the mixture, and ``pasto.hashing`` maps the unit to an arm, so the same unit gets the
same arm for the whole round in every process, and clients can assign locally with the same result.
"""

from __future__ import annotations

import numpy as np

from pasto.hashing import buckets, choose_arm, choose_arms

from .. import events
from ..cache import Snapshot
from ..errors import invalid, problems_error
from ..exposures import ExposureRecorder
from ..store import UnitOfWork
from .ingestion import segment_position, segment_problem


def assign_one(uow: UnitOfWork, name: str, unit: str, segment: str | None = None, segment_optional: bool = False,
               exposures: ExposureRecorder | None = None) -> tuple[Snapshot, bool, int, float, str | None]:
    """The snapshot served, whether it is stale (the database is unavailable: ``ExperimentCache.serve``),
    the arm position of ``unit``, its propensity and the segment whose mixture served it (None:
    unsegmented). A segmented experiment serves the mixture of the unit's ``segment`` (422 when it is
    missing or unknown, or given to an unsegmented experiment unless ``segment_optional``, with which
    an unsegmented experiment ignores it; in an open set a value without a mixture of its own, or no
    value, is served the long tail's, "(other)"). ``exposures``: the exposure log the assignment is
    recorded in (None: ``PASTO_EXPOSURE_LOG`` is not set)."""
    snapshot, stale = uow.cache.serve(name)
    if segment_optional and not snapshot.segmented:
        segment = None
    problem = segment_problem(snapshot, segment)
    if problem is not None:
        raise invalid("segment", problem)
    if not snapshot.segmented:
        arm, probability = choose_unsegmented(snapshot, unit)
    else:
        position = segment_position(snapshot, segment)
        arm = choose_arm(snapshot.segment_serving_cumulative[position], snapshot.hasher(unit))
        probability = float(snapshot.segment_serving[position, arm])
    served = snapshot.segment_names[position] if snapshot.segmented else None
    events.assigned.send(snapshot, arms=[arm])
    if exposures is not None:
        exposures.record(snapshot, [unit], [arm], None if served is None else [served])
    return snapshot, stale, arm, probability, served


def choose_unsegmented(snapshot: Snapshot, unit: str) -> tuple[int, float]:
    """The arm position of ``unit`` in the unsegmented experiment of ``snapshot``, and its propensity."""
    arm = choose_arm(snapshot.serving_cumulative, snapshot.hasher(unit))
    return arm, float(snapshot.serving[arm])


def choose_many_unsegmented(snapshot: Snapshot, units: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The arm positions of ``units`` in the unsegmented experiment of ``snapshot``, and their
    propensities; shapes (N,)."""
    u = buckets(snapshot.seed, units, snapshot.round_index)
    # choose_arms over the cumulative mixture computed once per snapshot version
    arms = np.searchsorted(snapshot.serving_cumulative_array, u, side="right")
    np.minimum(arms, snapshot.n_arms - 1, out=arms)
    return arms, snapshot.serving[arms]


def assign_many(uow: UnitOfWork, name: str, units: list[str], segments: list[str] | None = None,
                exposures: ExposureRecorder | None = None
                ) -> tuple[Snapshot, bool, np.ndarray, np.ndarray, list[str] | None]:
    """The snapshot served, whether it is stale, the arm position and propensity of each of ``units``,
    shapes (N,), and the segment whose mixture served each (None: unsegmented); a segmented experiment
    serves each unit its segment's mixture (``segments``, one per unit; a 422 naming every missing or
    unknown one, as :func:`assign_one`)."""
    snapshot, stale = uow.cache.serve(name)
    served = None
    if not snapshot.segmented and segments is None:
        arms, probabilities = choose_many_unsegmented(snapshot, units)
    else:
        u = buckets(snapshot.seed, units, snapshot.round_index)
        given = segments if segments is not None else [None] * len(units)
        problems = []
        for position, segment in enumerate(given):
            problem = segment_problem(snapshot, segment)
            if problem is not None:
                problems.append({"location": f"segments[{position}]", "message": problem})
        if problems:
            raise problems_error(problems)
        positions = np.fromiter((segment_position(snapshot, segment) for segment in given), dtype=np.int64,
                                count=len(given))
        arms = np.empty(len(units), dtype=np.int64)
        for position in np.unique(positions).tolist():
            members = positions == position
            arms[members] = choose_arms(snapshot.segment_serving[position], u[members])
        probabilities = snapshot.segment_serving[positions, arms]
        served = [snapshot.segment_names[position] for position in positions.tolist()]
    events.assigned.send(snapshot, arms=arms)
    if exposures is not None:
        exposures.record(snapshot, units, arms, served)
    return snapshot, stale, arms, probabilities, served
