"""Per-process cache of what assignment and ingestion need about each experiment.

A request reads one small row (``id, version``) by name, at most every ``PASTO_VERSION_CHECK_SECONDS``
(default 0.05 s) per experiment and process; the cached :class:`Snapshot` is reused while the version
matches and reloaded otherwise. Round boundaries, updates and status changes all bump
``experiments.version`` in the same transaction, so every worker process (gunicorn, waitress threads,
a separate scheduler) serves a new round within that interval, without any write on the assignment
path. Ingestion asks for a fresh check before rejecting an observation for a round it has not seen.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import sqlalchemy as sa
from flask import Flask, current_app

from pasto.hashing import PrefixHasher, cumulative_probabilities

from .db import Database, get_db
from .errors import ApiError
from .models import Arm, Experiment, Round

_EXTENSION = "pasto.cache"
_ROUND_CACHE_SIZE = 4096


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

    @property
    def n_arms(self) -> int:
        return len(self.arm_names)


class ExperimentCache:
    def __init__(self, database: Database, check_seconds: float) -> None:
        self.database = database
        self.check_seconds = check_seconds
        self._snapshots: dict[str, tuple[Snapshot, float]] = {}
        self._round_probabilities: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        placeholder = "%s" if database.engine.dialect.paramstyle in ("format", "pyformat") else "?"
        self._version_sql = f"SELECT id, version FROM experiments WHERE name = {placeholder}"

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
        row = self._version(name)
        if row is None:
            self._snapshots.pop(name, None)
            raise ApiError(404, "not_found", f"There is no experiment named {name!r}.")
        snapshot = cached[0] if cached is not None else None
        if snapshot is None or (snapshot.id, snapshot.version) != row:
            snapshot = self._load(name, snapshot)
        self._snapshots[name] = (snapshot, now)
        return snapshot

    def _version(self, name: str) -> tuple[int, int] | None:
        # The hottest query of the service: plain DBAPI, no ORM or SQL compilation on the way.
        connection = self.database.engine.raw_connection()
        try:
            cursor = connection.cursor()
            try:
                cursor.execute(self._version_sql, (name,))
                row = cursor.fetchone()
            finally:
                cursor.close()
            connection.rollback()
        finally:
            connection.close()
        return None if row is None else (int(row[0]), int(row[1]))

    def round_probabilities(self, snapshot: Snapshot, round_index: int) -> np.ndarray:
        """The propensities served in ``round_index`` (immutable once the round exists)."""
        if round_index == snapshot.round_index:
            return snapshot.probabilities
        key = (snapshot.id, round_index)
        cached = self._round_probabilities.get(key)
        if cached is not None:
            return cached
        with self.database.read() as session:
            probabilities = session.execute(
                sa.select(Round.probabilities).where(Round.experiment_id == snapshot.id, Round.index == round_index)
            ).scalar_one_or_none()
        if probabilities is None:
            raise LookupError(f"Round {round_index} of {snapshot.name!r} does not exist.")
        array = np.asarray(probabilities, dtype=np.float64)
        with self._lock:
            self._round_probabilities[key] = array
            while len(self._round_probabilities) > _ROUND_CACHE_SIZE:
                self._round_probabilities.popitem(last=False)
        return array

    def _load(self, name: str, previous: Snapshot | None = None) -> Snapshot:
        with self.database.read() as session:
            experiment = session.execute(sa.select(Experiment).where(Experiment.name == name)).scalar_one_or_none()
            if experiment is None:
                raise ApiError(404, "not_found", f"There is no experiment named {name!r}.")
            if previous is not None and (previous.id, previous.created_at) == (experiment.id, experiment.created_at):
                # Arms never change once created: a new version (round, update, status) reuses them,
                # which saves parsing K JSON params documents per reload (most of it at K = 10,000).
                arm_names, arm_params, arm_positions = previous.arm_names, previous.arm_params, previous.arm_positions
            else:
                arms = session.execute(
                    sa.select(Arm.name, Arm.params).where(Arm.experiment_id == experiment.id).order_by(Arm.position)
                ).all()
                arm_names = tuple(arm.name for arm in arms)
                arm_params = tuple(arm.params for arm in arms)
                arm_positions = {arm_name: position for position, arm_name in enumerate(arm_names)}
            current = session.execute(
                sa.select(Round).where(Round.experiment_id == experiment.id, Round.index == experiment.round_index)
            ).scalar_one()
        probabilities = np.asarray(current.probabilities, dtype=np.float64)
        deployed = np.asarray(experiment.state["deployed"], dtype=np.float64)
        serving = deployed if experiment.status == "stopped" else probabilities
        metrics = tuple(experiment.config["metrics"])
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
            serving_cumulative=cumulative_probabilities(serving),
            hasher=PrefixHasher(experiment.seed, experiment.round_index),
        )


def init_app(app: Flask) -> None:
    app.extensions[_EXTENSION] = ExperimentCache(get_db(app), float(app.config["PASTO_VERSION_CHECK_SECONDS"]))


def get_cache(app: Flask | None = None) -> ExperimentCache:
    return (app or current_app).extensions[_EXTENSION]
