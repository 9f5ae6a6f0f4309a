"""What the reliability tests send and how they check what the database made of it.

* :class:`Writer`: one seeded client of the HTTP API. It asks the server for the sticky arms of a
  batch of units (``POST .../assign``), then sends their observations (``POST .../observations``).
  A batch whose answer never came (connection refused or reset: the server crashed) stays
  unacknowledged and is re-sent unchanged, same ids, by the next :meth:`Writer.run`: exactly what a
  client that retries does. Some batches can also be sent twice at once, from two connections.
* :func:`expected_statistics`: the ground truth, computed with numpy from every observation the
  writers sent, each id once, independently of the service's own aggregation code.
* :func:`stored_statistics`, :func:`assert_same_statistics`, :func:`assert_api_rounds_match`: the
  tables ``round_statistics`` / ``arm_round_counts`` and ``GET .../rounds`` against that truth.
* :func:`assert_round_chain` and :func:`replay`: one ``rounds`` row per index, each closed round
  followed by the next without a gap, and the controller state equal to what
  ``pasto.algorithm.update`` gives when every closed round is applied once, offline, from the stored
  per-round statistics and the stored propensities. A round applied twice (or skipped) makes the
  replay differ from the stored state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa

from pasto.algorithm import AlgorithmConfig, ControllerState, initial_state, round_generator, update
from pasto_client import Client, PastoConnectionError
from pasto.estimators import Statistics
from pasto.objectives import Objective
from service.models import Arm, ArmRoundCount, Experiment, Round, RoundStatistic
from tests.round_counts import assert_round_counts_match
from tests.service.conftest import ADMIN_TOKEN, setup_a_body

NAME = "reliability"
ARMS = ("a", "b")
METRICS = ("x", "y")
#: Mean of (x, y) per arm (setup A of the paper) plus N(0, 1) noise: what the data looks like does not
#: matter to these tests, only that every value is counted exactly once.
MEANS = {"a": (2.0, -2.0), "b": (0.0, 2.0)}


def experiment_body(**overrides: Any) -> dict[str, Any]:
    """Setup A (two arms, metrics x and y, a guardrail on y) under the name :data:`NAME`."""
    return setup_a_body(NAME, **overrides)


def create_experiment(base_url: str, **overrides: Any) -> dict:
    with Client(base_url, ADMIN_TOKEN, timeout=60) as client:
        return client.create_experiment(**experiment_body(**overrides))


# ------------------------------------------------------------------------------------ writers
@dataclass(frozen=True)
class Batch:
    index: int
    observations: list[dict[str, Any]]


class InFlight:
    """Number of observation requests sent and not answered yet, over every writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.answered = 0

    def __enter__(self) -> None:
        with self._lock:
            self.count += 1

    def __exit__(self, exc_type, *_: object) -> None:
        with self._lock:
            self.count -= 1
            if exc_type is None:
                self.answered += 1


@dataclass
class Writer:
    """Writer ``writer_index``: ``n_batches`` batches of ``batch_size`` observations of its own units.

    Batch ``b`` is drawn from ``numpy.random.default_rng([seed, writer_index, b])``: the same data
    whenever it is built. ``resend_share`` of the batches (chosen with the same seed) are sent twice
    concurrently, from two connections, with the same ids.
    """

    writer_index: int
    seed: int
    n_batches: int
    batch_size: int
    resend_share: float = 0.0
    n_units: int = 2000
    built: dict[int, Batch] = field(init=False, default_factory=dict)
    answers: dict[int, list[dict]] = field(init=False, default_factory=dict)  # acknowledged -> 202 bodies
    resent: frozenset[int] = field(init=False, default=frozenset())  # batches sent twice at once

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, self.writer_index])
        n_resent = round(self.resend_share * self.n_batches)
        self.resent = frozenset(rng.choice(self.n_batches, size=n_resent, replace=False).tolist())

    @property
    def finished(self) -> bool:
        return len(self.answers) == self.n_batches

    @property
    def unacknowledged(self) -> list[int]:
        return sorted(set(self.built) - set(self.answers))

    def _build(self, client: Client, index: int) -> Batch:
        rng = np.random.default_rng([self.seed, self.writer_index, index])
        units = [f"w{self.writer_index}-u{u}" for u in rng.integers(0, self.n_units, size=self.batch_size).tolist()]
        noise = rng.normal(size=(self.batch_size, len(METRICS))).tolist()
        assignments = client.assign_many(NAME, units)
        observations = []
        for position, (unit, assignment, (noise_x, noise_y)) in enumerate(zip(units, assignments, noise)):
            mean_x, mean_y = MEANS[assignment.arm]
            observations.append({
                "id": f"w{self.writer_index}-b{index}-{position}", "unit": unit,
                "round": assignment.round, "arm": assignment.arm,
                "values": {"x": mean_x + noise_x, "y": mean_y + noise_y},
            })
        batch = Batch(index, observations)
        self.built[index] = batch
        return batch

    def _next(self, client: Client) -> Batch | None:
        pending = self.unacknowledged
        if pending:
            return self.built[pending[0]]
        if len(self.built) < self.n_batches:
            return self._build(client, len(self.built))
        return None

    def run(self, base_url: str, in_flight: InFlight | None = None) -> None:
        """Send until every batch is acknowledged or the server cannot be reached.

        An error answer (4xx/5xx) raises: nothing the writers send is invalid, so it is a bug.
        """
        in_flight = in_flight or InFlight()
        with Client(base_url, ADMIN_TOKEN, timeout=120) as client, \
                Client(base_url, ADMIN_TOKEN, timeout=120) as twin, ThreadPoolExecutor(2) as senders:
            while True:
                try:
                    batch = self._next(client)
                except PastoConnectionError:
                    return
                if batch is None:
                    return
                copies = [client] + ([twin] if batch.index in self.resent else [])
                try:
                    with in_flight:
                        futures = [senders.submit(sender.observe, NAME, batch.observations) for sender in copies]
                        wait(futures)
                        answers = [future.result() for future in futures]
                except PastoConnectionError:
                    return  # no answer: the batch stays unacknowledged and is re-sent by the next run
                self.answers[batch.index] = answers

    def sent_observations(self) -> Iterable[dict[str, Any]]:
        """Every observation of an acknowledged batch (once, however often it was sent)."""
        for index in sorted(self.answers):
            yield from self.built[index].observations


def run_writers(writers: Sequence[Writer], base_url: str, in_flight: InFlight | None = None) -> None:
    """Run every writer in a thread of its own until each returns; re-raises the first error."""
    with ThreadPoolExecutor(len(writers)) as pool:
        futures = [pool.submit(writer.run, base_url, in_flight) for writer in writers]
        for future in futures:
            future.result()


def unique_observations(writers: Sequence[Writer]) -> list[dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    for writer in writers:
        for observation in writer.sent_observations():
            assert by_id.setdefault(observation["id"], observation) is observation, "ids must be unique"
    return list(by_id.values())


# ------------------------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class CellStatistics:
    """Statistics per round and arm: ``counts``/``sums``/``sums_of_squares`` are (R, K, M) per metric,
    ``observations``/``units`` are (R, K); ``magnitudes`` (sum of |value|, expected side only) scales
    the tolerance of float sums, whose rounding depends on the order of additions."""

    counts: np.ndarray
    sums: np.ndarray
    sums_of_squares: np.ndarray
    observations: np.ndarray
    units: np.ndarray
    magnitudes: np.ndarray | None = None

    @property
    def n_rounds(self) -> int:
        return self.counts.shape[0]


def expected_statistics(observations: Sequence[dict[str, Any]], n_rounds: int) -> CellStatistics:
    """What the database must hold after ``observations`` (each id once), computed with numpy."""
    shape = (n_rounds, len(ARMS), len(METRICS))
    rounds = np.array([observation["round"] for observation in observations], dtype=np.int64)
    arms = np.array([ARMS.index(observation["arm"]) for observation in observations], dtype=np.int64)
    values = np.array([[observation["values"][metric] for metric in METRICS] for observation in observations],
                      dtype=np.float64).reshape(-1, len(METRICS))
    counts = np.zeros(shape, dtype=np.int64)
    sums = np.zeros(shape)
    sums_of_squares = np.zeros(shape)
    magnitudes = np.zeros(shape)
    np.add.at(counts, (rounds, arms), 1)
    np.add.at(sums, (rounds, arms), values)
    np.add.at(sums_of_squares, (rounds, arms), values * values)
    np.add.at(magnitudes, (rounds, arms), np.abs(values))
    observation_counts = np.zeros(shape[:2], dtype=np.int64)
    np.add.at(observation_counts, (rounds, arms), 1)
    units = np.zeros(shape[:2], dtype=np.int64)
    for round_index, arm, _unit in {(o["round"], ARMS.index(o["arm"]), o["unit"]) for o in observations}:
        units[round_index, arm] += 1
    return CellStatistics(counts, sums, sums_of_squares, observation_counts, units, magnitudes)


def experiment_id(connection: sa.Connection, name: str = NAME) -> int:
    return connection.execute(sa.select(Experiment.id).where(Experiment.name == name)).scalar_one()


def stored_statistics(engine: sa.Engine, n_rounds: int, name: str = NAME) -> CellStatistics:
    """``round_statistics`` and ``arm_round_counts`` of rounds < ``n_rounds``; rows of later rounds must
    not exist (nothing was sent for them). Asserts that ``round_counts`` holds their sums over the arms."""
    shape = (n_rounds, len(ARMS), len(METRICS))
    counts = np.zeros(shape, dtype=np.int64)
    sums = np.zeros(shape)
    sums_of_squares = np.zeros(shape)
    observations = np.zeros(shape[:2], dtype=np.int64)
    units = np.zeros(shape[:2], dtype=np.int64)
    statistic, arm_count = RoundStatistic.__table__, ArmRoundCount.__table__
    with engine.connect() as connection:
        identifier = experiment_id(connection, name)
        for row in connection.execute(sa.select(statistic).where(statistic.c.experiment_id == identifier)):
            assert row.round_index < n_rounds, f"statistics stored for round {row.round_index}, where nothing was sent"
            cell = (row.round_index, row.arm_index, row.metric_index)
            counts[cell], sums[cell], sums_of_squares[cell] = row.count, row.sum, row.sum_of_squares
        for row in connection.execute(sa.select(arm_count).where(arm_count.c.experiment_id == identifier)):
            assert row.round_index < n_rounds, f"counts stored for round {row.round_index}, where nothing was sent"
            observations[row.round_index, row.arm_index] = row.observations
            units[row.round_index, row.arm_index] = row.units
    assert_round_counts_match(engine)  # the per-round totals the writers keep, in the same transactions
    return CellStatistics(counts, sums, sums_of_squares, observations, units)


def _sum_tolerance(scale: np.ndarray) -> np.ndarray:
    return 1e-9 * scale + 1e-12


def assert_same_statistics(expected: CellStatistics, stored: CellStatistics) -> None:
    """Counts exactly equal; float sums equal to 1e-9 of the sum of the magnitudes added."""
    np.testing.assert_array_equal(stored.counts, expected.counts, err_msg="observations per round, arm, metric")
    np.testing.assert_array_equal(stored.observations, expected.observations, err_msg="observations per round, arm")
    np.testing.assert_array_equal(stored.units, expected.units, err_msg="distinct units per round, arm")
    assert expected.magnitudes is not None
    sum_error = np.abs(stored.sums - expected.sums)
    assert np.all(sum_error <= _sum_tolerance(expected.magnitudes)), f"sums differ by up to {sum_error.max()}"
    square_error = np.abs(stored.sums_of_squares - expected.sums_of_squares)
    assert np.all(square_error <= _sum_tolerance(expected.sums_of_squares)), (
        f"sums of squares differ by up to {square_error.max()}")


def assert_api_rounds_match(client: Client, expected: CellStatistics) -> list[dict]:
    """``GET .../rounds``: per round and arm, the counts, distinct units and means of what was sent."""
    rounds = client.rounds(NAME)
    assert [entry["index"] for entry in rounds] == list(range(len(rounds)))
    assert len(rounds) >= expected.n_rounds
    for entry in rounds:
        index = entry["index"]
        if index >= expected.n_rounds:
            assert entry["counts"] == [0] * len(ARMS) and entry["late_observations"] == 0, entry
            continue
        assert entry["counts"] == expected.observations[index].tolist(), (index, entry["counts"])
        assert entry["units"] == expected.units[index].tolist(), (index, entry["units"])
        assert 0 <= entry["late_observations"] <= sum(entry["counts"])
        for metric_position, metric in enumerate(METRICS):
            for arm_position in range(len(ARMS)):
                count = expected.counts[index, arm_position, metric_position]
                mean = entry["means"][metric][arm_position]
                if count == 0:
                    assert mean is None
                    continue
                expected_mean = expected.sums[index, arm_position, metric_position] / count
                tolerance = _sum_tolerance(expected.magnitudes[index, arm_position, metric_position]) / count
                assert abs(mean - expected_mean) <= tolerance, (index, metric, arm_position, mean, expected_mean)
    return rounds


# ------------------------------------------------------------------------------------ rounds
@dataclass(frozen=True)
class StoredRounds:
    experiment: Any  # the experiments row
    rounds: list[Any]  # the rounds rows, by index
    arm_names: list[str]


def stored_rounds(engine: sa.Engine, name: str = NAME) -> StoredRounds:
    rounds, arms = Round.__table__, Arm.__table__
    with engine.connect() as connection, connection.begin():
        experiment = connection.execute(sa.select(Experiment.__table__).where(Experiment.name == name)).one()
        round_rows = connection.execute(
            sa.select(rounds).where(rounds.c.experiment_id == experiment.id).order_by(rounds.c.index)).all()
        arm_names = connection.execute(
            sa.select(arms.c.name).where(arms.c.experiment_id == experiment.id).order_by(arms.c.position)
        ).scalars().all()
    return StoredRounds(experiment, list(round_rows), list(arm_names))


def assert_round_chain(engine: sa.Engine, name: str = NAME) -> StoredRounds:
    """One row per round 0..round_index, each closed round followed at once by the next, every closed
    round applied (settle time 0), the current one open. Call it with no scheduler running."""
    stored = stored_rounds(engine, name)
    experiment, rounds = stored.experiment, stored.rounds
    assert [row.index for row in rounds] == list(range(experiment.round_index + 1))
    assert experiment.applied_rounds == experiment.round_index, "every closed round is applied once (settle 0)"
    for row, following in zip(rounds, rounds[1:]):
        assert row.closed_at is not None and row.applied_at is not None and row.deployed is not None, row.index
        assert following.started_at == row.closed_at, f"gap or overlap after round {row.index}"
    current = rounds[-1]
    assert current.closed_at is None and current.applied_at is None
    for row in rounds:
        assert abs(sum(row.probabilities) - 1.0) < 1e-9 and min(row.probabilities) > 0
    return stored


def _round_statistics(engine: sa.Engine, experiment_identifier: int, n_rounds: int, n_metrics: int,
                      n_arms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    table = RoundStatistic.__table__
    counts = np.zeros((n_rounds, n_metrics, n_arms))
    sums = np.zeros((n_rounds, n_metrics, n_arms))
    sums_of_squares = np.zeros((n_rounds, n_metrics, n_arms))
    with engine.connect() as connection:
        for row in connection.execute(sa.select(table).where(table.c.experiment_id == experiment_identifier)):
            if row.round_index < n_rounds:
                cell = (row.round_index, row.metric_index, row.arm_index)
                counts[cell], sums[cell], sums_of_squares[cell] = row.count, row.sum, row.sum_of_squares
    return counts, sums, sums_of_squares


def replay(engine: sa.Engine, name: str = NAME, apply_twice: int | None = None) -> tuple[ControllerState, list[str]]:
    """Apply the updates of rounds 0 .. applied_rounds - 1 offline, once each (round ``apply_twice``
    twice, to show that the comparison notices), from the stored per-round statistics and propensities.

    Returns the replayed state and the differences found on the way: the mixture each round deployed
    and the propensities of the round after it must be the replay's.
    """
    stored = stored_rounds(engine, name)
    experiment, rounds = stored.experiment, stored.rounds
    config = experiment.config
    algorithm = AlgorithmConfig.from_dict({k: v for k, v in config["algorithm"].items() if k != "preset"})
    objective = Objective.from_spec(config["metrics"], config["objective"], arm_names=stored.arm_names)
    n_metrics, n_arms = len(config["metrics"]), len(stored.arm_names)
    counts, sums, sums_of_squares = _round_statistics(engine, experiment.id, experiment.applied_rounds,
                                                      n_metrics, n_arms)
    state = initial_state(algorithm, n_arms, n_metrics)
    differences = state_differences(state.probabilities.tolist(), rounds[0].probabilities, "round 0 probabilities")
    for index in range(experiment.applied_rounds):
        this_round = Statistics(counts=counts[index], sums=sums[index], sums_of_squares=sums_of_squares[index])
        # The server adds each round's rows into running totals (service.store.fold_statistics), in
        # round order like this sum over axis 0, but the database adds within an update in its own order:
        # float sums can differ in the last bits, so the replay compares the states to 1e-7 relative
        # (state_differences) rather than mirroring the database's addition order.
        pooled = Statistics(counts=counts[:index + 1].sum(axis=0), sums=sums[:index + 1].sum(axis=0),
                            sums_of_squares=sums_of_squares[:index + 1].sum(axis=0))
        propensities = np.asarray(rounds[index].probabilities, dtype=np.float64)
        for _ in range(2 if index == apply_twice else 1):
            # The server's close draws from round_generator(experiment seed, round): the replay too.
            state = update(algorithm, objective, state, this_round, pooled, propensities=propensities,
                           rng=round_generator(experiment.seed, index + 1))
        differences += state_differences(state.deployed.tolist(), rounds[index].deployed, f"round {index} deployed")
        differences += state_differences(state.probabilities.tolist(), rounds[index + 1].probabilities,
                                         f"round {index + 1} probabilities")
    differences += state_differences(state.to_dict(), experiment.state, "state")
    return state, differences


def state_differences(replayed: Any, stored: Any, where: str) -> list[str]:
    """Where two JSON-like values differ: integers, strings and structure exactly, floats to 1e-7
    relative (the stored sums were added up by the database in its own order)."""
    if isinstance(replayed, dict) and isinstance(stored, dict):
        if set(replayed) != set(stored):
            return [f"{where}: keys {sorted(replayed)} != {sorted(stored)}"]
        return [difference for key in replayed
                for difference in state_differences(replayed[key], stored[key], f"{where}.{key}")]
    if isinstance(replayed, list) and isinstance(stored, list):
        if len(replayed) != len(stored):
            return [f"{where}: length {len(replayed)} != {len(stored)}"]
        return [difference for position, (a, b) in enumerate(zip(replayed, stored))
                for difference in state_differences(a, b, f"{where}[{position}]")]
    if isinstance(replayed, float) or isinstance(stored, float):
        if isinstance(replayed, (int, float)) and isinstance(stored, (int, float)) and \
                abs(replayed - stored) <= 1e-7 * max(abs(replayed), abs(stored)) + 1e-12:
            return []
        return [f"{where}: replayed {replayed!r}, stored {stored!r}"]
    return [] if replayed == stored else [f"{where}: replayed {replayed!r}, stored {stored!r}"]


def assert_replay_matches(engine: sa.Engine, name: str = NAME) -> ControllerState:
    """Every closed round applied exactly once: the offline replay equals the stored state."""
    state, differences = replay(engine, name)
    assert not differences, "\n".join(differences[:20])
    assert state.round_index == stored_rounds(engine, name).experiment.applied_rounds
    return state


def wait_until(condition, seconds: float, message: str, interval: float = 0.02):
    """Poll ``condition()`` until it returns something truthy (returned), at most ``seconds``."""
    # Hang guard, not a tolerance: callers give `seconds` (20-120) far above what the awaited step takes under
    # load; only a failing run reaches it.
    deadline = time.monotonic() + seconds
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, message
        time.sleep(interval)
