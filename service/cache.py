"""Per-process cache of what assignment and ingestion need about each experiment (read through
``service.store``).

A request reads one small row (``id, version``) by name, at most every ``PASTO_VERSION_CHECK_SECONDS``
(default 0.05 s) per experiment and process; the cached :class:`Snapshot` is reused while the version
matches and reloaded otherwise. Round boundaries, updates and status changes all bump
``experiments.version`` in the same transaction, so every worker process (gunicorn, waitress threads,
a separate scheduler) serves a new round within that interval, without any write on the assignment
path. Ingestion asks for a fresh check before rejecting an observation for a round it has not seen.

Assignment needs no write, so it survives a database outage: when the version check fails because
the database is unavailable and a snapshot is cached, :meth:`ExperimentCache.serve` answers with that
snapshot, marked stale, and checks again at most every :data:`OUTAGE_RECHECK_SECONDS` (so a stalled
database costs one slow request per interval, not one per request).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from pasto.hashing import PrefixHasher, cumulative_probabilities

from . import store
from .db import Database, is_unavailable_error
from .errors import ApiError

_ROUND_CACHE_SIZE = 4096

#: While the database is unavailable, a process retries an experiment's version check at most this
#: often; requests in between are served the cached (stale) snapshot without waiting for it.
OUTAGE_RECHECK_SECONDS = 1.0


@dataclass(frozen=True, eq=False)
class Snapshot:
    """An experiment as of one ``version``: immutable, shared between threads.

    ``serving`` is the mixture assignment samples from now: the current round's probabilities p_t,
    or the deployed mixture once the experiment is stopped.
    """

    id: int
    name: str
    version: int
    status: str
    seed: int
    config: dict[str, Any]
    state: dict[str, Any]
    round_index: int
    applied_rounds: int
    round_started_at: datetime
    round_ends_at: datetime
    created_at: datetime
    updated_at: datetime
    arm_names: tuple[str, ...]
    arm_params: tuple[dict[str, Any], ...]
    arm_positions: dict[str, int]
    metrics: tuple[str, ...]
    metric_positions: dict[str, int]
    probabilities: np.ndarray  # (K,) p_t of the current round
    deployed: np.ndarray  # (K,)
    serving: np.ndarray  # (K,)
    serving_cumulative: list[float]
    hasher: PrefixHasher
    #: (K,) ``serving_cumulative`` as float64, for batches (``np.searchsorted``).
    serving_cumulative_array: np.ndarray
    # Segmented experiments only (``config["segments"]``): the segment names, their positions, and per
    # segment (S, K) the current round's p_t, the deployed mixtures and what assignment samples from.
    segment_names: tuple[str, ...] = ()
    segment_positions: dict[str, int] = field(default_factory=dict)
    segment_probabilities: np.ndarray | None = None
    segment_deployed: np.ndarray | None = None
    segment_serving: np.ndarray | None = None
    segment_serving_cumulative: tuple[list[float], ...] = ()
    segment_open: bool = False  # an open set: unknown values (and no value) are served segment 0, "(other)"
    archived_at: datetime | None = None
    #: What the assign endpoint answers for each (segment position or -1, arm) drawn so far in this
    #: version: the JSON members after the unit (``service.responses.assignment_members``), built on first use.
    answer_members: dict[tuple[int, int], str] = field(default_factory=dict, repr=False)

    @property
    def n_arms(self) -> int:
        return len(self.arm_names)

    @property
    def segmented(self) -> bool:
        return bool(self.segment_names)


class ExperimentCache:
    def __init__(self, database: Database, check_seconds: float) -> None:
        self.database = database
        self.check_seconds = check_seconds
        self._snapshots: dict[str, tuple[Snapshot, float]] = {}
        self._round_probabilities: OrderedDict[tuple[int, int, str], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._stale_until: dict[str, float] = {}  # name -> monotonic time of the next check in an outage

    def get(self, name: str, fresh: bool = False, check: bool = True) -> Snapshot:
        """The snapshot of experiment ``name``, checked against the database unless it was checked
        less than ``check_seconds`` ago (always when ``fresh``; never when a snapshot is cached and
        ``check`` is false); 404 when there is no such experiment.

        ``check=False`` is for ingestion: what it takes from a snapshot is fixed once a round has
        started (arms, metrics, each round's propensities), an observation for a round newer than the
        snapshot's asks again with ``fresh``, and what can change (status, applied rounds) it reads
        under the experiment's row lock in its own transaction. That saves a query per batch.
        """
        cached = self._snapshots.get(name)
        now = time.monotonic()
        if cached is not None and not fresh and (not check or now - cached[1] < self.check_seconds):
            return cached[0]
        row = store.experiment_version(self.database, name)
        if row is None:
            self._snapshots.pop(name, None)
            raise ApiError(404, "not_found", f"There is no experiment named {name!r}.")
        snapshot = cached[0] if cached is not None else None
        if snapshot is None or (snapshot.id, snapshot.version) != row:
            snapshot = self._load(name, snapshot)
        self._snapshots[name] = (snapshot, now)
        return snapshot

    def holds(self, name: str) -> bool:
        """Whether a snapshot of ``name`` is cached (:meth:`serve` then answers even during an outage)."""
        return name in self._snapshots

    def forget(self, name: str) -> None:
        """Drop the snapshot of ``name`` (deleted): the next request asks the database."""
        self._snapshots.pop(name, None)
        self._stale_until.pop(name, None)

    def serve(self, name: str) -> tuple[Snapshot, bool]:
        """The snapshot assignment serves for experiment ``name`` and whether it is stale: when the
        version check (or the reload) fails because the database is unavailable and a snapshot of
        ``name`` is cached, that snapshot (``True``); the outage is recorded in the database status.
        Without a cached snapshot the error propagates (503 ``database_unavailable``)."""
        cached = self._snapshots.get(name)
        now = time.monotonic()
        if cached is not None and now < self._stale_until.get(name, 0.0):
            return cached[0], True
        try:
            return self.get(name), False
        except Exception as error:
            if cached is None or not is_unavailable_error(error):
                raise
            self.database.status.failed(error)
            self._stale_until[name] = time.monotonic() + OUTAGE_RECHECK_SECONDS
            return cached[0], True

    def round_probabilities(self, snapshot: Snapshot, round_index: int) -> np.ndarray:
        """The propensities served in ``round_index`` (immutable once the round exists)."""
        if round_index == snapshot.round_index:
            return snapshot.probabilities
        return self._round_array(snapshot, round_index, "probabilities", store.round_probabilities)

    def round_segment_probabilities(self, snapshot: Snapshot, round_index: int) -> np.ndarray:
        """The per-segment propensities (S, K) served in ``round_index`` of a segmented experiment."""
        if round_index == snapshot.round_index:
            return snapshot.segment_probabilities
        return self._round_array(snapshot, round_index, "segment_probabilities", store.round_segment_probabilities)

    def _round_array(self, snapshot: Snapshot, round_index: int, kind: str,
                     read: Callable[[Database, int, int], list | None]) -> np.ndarray:
        """A past round's array of ``kind``, read once with ``read(database, experiment_id, round_index)``
        and kept in a small LRU cache (a round's propensities never change once it exists)."""
        key = (snapshot.id, round_index, kind)
        cached = self._round_probabilities.get(key)
        if cached is not None:
            return cached
        values = read(self.database, snapshot.id, round_index)
        if values is None:
            raise LookupError(f"Round {round_index} of {snapshot.name!r} does not exist.")
        array = np.asarray(values, dtype=np.float64)
        with self._lock:
            self._round_probabilities[key] = array
            while len(self._round_probabilities) > _ROUND_CACHE_SIZE:
                self._round_probabilities.popitem(last=False)
        return array

    def _load(self, name: str, previous: Snapshot | None = None) -> Snapshot:
        with self.database.read() as session:
            loaded = store.load_experiment(session, name)
            if loaded is None:
                raise ApiError(404, "not_found", f"There is no experiment named {name!r}.")
            experiment, current = loaded
            if previous is not None and (previous.id, previous.created_at) == (experiment.id, experiment.created_at):
                # Arms never change once created: a new version (round, update, status) reuses them,
                # which saves parsing K JSON params documents per reload (most of it at K = 10,000).
                arm_names, arm_params, arm_positions = previous.arm_names, previous.arm_params, previous.arm_positions
            else:
                arms = store.arms(session, experiment.id)
                arm_names = tuple(arm_name for arm_name, _ in arms)
                arm_params = tuple(params for _, params in arms)
                arm_positions = {arm_name: position for position, arm_name in enumerate(arm_names)}
        probabilities = np.asarray(current.probabilities, dtype=np.float64)
        deployed = np.asarray(experiment.state["deployed"], dtype=np.float64)
        serving = deployed if experiment.status == "stopped" else probabilities
        serving_cumulative = cumulative_probabilities(serving)
        metrics = tuple(experiment.config["metrics"])
        segmented: dict[str, Any] = {}
        if experiment.config.get("segments") is not None:
            segment_probabilities = np.asarray(current.segment_probabilities, dtype=np.float64)
            segment_deployed = np.asarray(experiment.segment_state["controller"]["deployed"], dtype=np.float64)
            segment_serving = segment_deployed if experiment.status == "stopped" else segment_probabilities
            # An open set's value that got its mixture by an update that started no round is served
            # the long tail's until the next round starts: only the segments the round serves count.
            names = tuple(experiment.segment_state["names"][:len(segment_serving)])
            segmented = dict(
                segment_names=names,
                segment_positions={segment: position for position, segment in enumerate(names)},
                segment_probabilities=segment_probabilities,
                segment_deployed=segment_deployed,
                segment_serving=segment_serving,
                segment_serving_cumulative=tuple(cumulative_probabilities(row) for row in segment_serving),
                segment_open=experiment.config["segments"].get("by") is not None,
            )
        return Snapshot(
            id=experiment.id,
            name=experiment.name,
            version=experiment.version,
            status=experiment.status,
            seed=experiment.seed,
            config=experiment.config,
            state=experiment.state,
            round_index=experiment.round_index,
            applied_rounds=experiment.applied_rounds,
            round_started_at=current.started_at,
            round_ends_at=current.ends_at,
            created_at=experiment.created_at,
            updated_at=experiment.updated_at,
            arm_names=arm_names,
            arm_params=arm_params,
            arm_positions=arm_positions,
            metrics=metrics,
            metric_positions={metric: position for position, metric in enumerate(metrics)},
            probabilities=probabilities,
            deployed=deployed,
            serving=serving,
            serving_cumulative=serving_cumulative,
            serving_cumulative_array=np.asarray(serving_cumulative, dtype=np.float64),
            hasher=PrefixHasher(experiment.seed, experiment.round_index),
            archived_at=experiment.archived_at,
            **segmented,
        )

