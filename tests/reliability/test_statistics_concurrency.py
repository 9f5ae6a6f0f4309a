"""Concurrent statistics writers through real server processes: every batch applied exactly once.

8 writers each push 30 batches of pre-aggregated cells (``POST .../statistics`` through
``pasto_client.Client.send_statistics``) for the round being served when the batch is built; rounds
last 1 s and a scheduler closes them meanwhile, so on-time and late cells interleave with closes.
10% of the batches are sent twice at the same time from two connections with the same id and content;
5 batches are sent at the same time in two versions (same id, different content).

* SQLite: one ``pasto serve`` process (waitress, 8 threads, its own scheduler).
* PostgreSQL: ``gunicorn -w 4`` plus one ``pasto worker`` (the multi-process deployment).

Each test proves:

* each same-content pair is answered once applied (202) and once duplicate (200), in either order;
* each conflicting pair is answered once applied (202) and once 409 naming the id: the version that
  won is the one applied;
* ``round_statistics`` holds, per (round, arm, metric), exactly the sums of the applied batches (counts
  and the units and observations of ``arm_round_counts`` exactly, and ``round_counts`` their sums over
  the arms, float sums to 1e-9 relative);
  ``statistics_batches`` has one row per batch id.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import pytest
import sqlalchemy as sa

from pasto_client import Client, PastoAPIError
from service.models import ArmRoundCount, Experiment, RoundStatistic, StatisticsBatch
from tests.reliability.harness import ADMIN_TOKEN, ARMS, METRICS, NAME, create_experiment
from tests.round_counts import assert_round_counts_match

WRITERS = 8
BATCHES_PER_WRITER = 30
RESEND_SHARE = 0.1
CONFLICTS = 5
SEED = 20261124


def build_batch(writer: int, index: int, round_index: int, variant: int = 0) -> dict:
    """Batch ``index`` of ``writer`` for ``round_index``: cells summarising random values (so every
    sum of squares is consistent), the same whenever built; ``variant`` 1 is other content."""
    rng = np.random.default_rng([SEED, writer, index, variant])
    cells, units = [], []
    for arm in ARMS:
        n = int(rng.integers(1, 40))
        units.append({"round": round_index, "arm": arm, "units": int(rng.integers(1, n + 1))})
        for metric in METRICS:
            values = rng.normal(1.5, 2.0, size=int(rng.integers(1, n + 1)))
            cells.append({"round": round_index, "arm": arm, "metric": metric, "count": int(values.size),
                          "sum": float(values.sum()), "sum_of_squares": float((values ** 2).sum())})
    return {"batch_id": f"w{writer}-b{index}", "cells": cells, "units": units}


@dataclass
class StatisticsWriter:
    index: int
    resent: frozenset[int]
    conflicting: frozenset[int]
    applied: list[dict] = field(default_factory=list)  # the batches (versions) answered 202
    answers: list[tuple[str, int, bool | None]] = field(default_factory=list)  # (batch id, status, duplicate)

    def run(self, base_url: str) -> None:
        with Client(base_url, ADMIN_TOKEN, timeout=120) as client, \
                Client(base_url, ADMIN_TOKEN, timeout=120) as twin, ThreadPoolExecutor(2) as senders:
            first_round = client.get_experiment(NAME)["round"]["index"]
            for batch_index in range(BATCHES_PER_WRITER):
                if batch_index == BATCHES_PER_WRITER // 2:
                    # The second half goes to a later round whatever the machine's speed: batches for a
                    # round that closed meanwhile must still be applied exactly once (late statistics).
                    wait_for_round_after(client, first_round)
                round_index = client.get_experiment(NAME)["round"]["index"]
                versions = [build_batch(self.index, batch_index, round_index)]
                if batch_index in self.resent:
                    versions.append(versions[0])
                elif batch_index in self.conflicting:
                    versions.append(build_batch(self.index, batch_index, round_index, variant=1))
                futures = [senders.submit(self._send, sender, version)
                           for sender, version in zip((client, twin), versions)]
                wait(futures)
                for version, future in zip(versions, futures):
                    status, duplicate = future.result()
                    self.answers.append((version["batch_id"], status, duplicate))
                    if status == 202:
                        self.applied.append(version)

    @staticmethod
    def _send(client: Client, batch: dict) -> tuple[int, bool | None]:
        try:
            answer = client.send_statistics(NAME, batch["batch_id"], batch["cells"], batch["units"])
        except PastoAPIError as error:
            assert error.status == 409 and error.code == "conflict", error
            assert batch["batch_id"] in error.message and error.details == {"batch_id": batch["batch_id"]}
            return 409, None
        assert answer["batch_id"] == batch["batch_id"]
        if answer["duplicate"]:
            assert (answer["cells"], answer["units"]) == (0, 0)
            return 200, True
        assert (answer["cells"], answer["units"]) == (len(batch["cells"]), len(batch["units"]))
        return 202, False


def wait_for_round_after(client: Client, round_index: int) -> None:
    """Until the scheduler has started a round after ``round_index`` (1-second rounds)."""
    deadline = time.monotonic() + 60  # hang guard, not a tolerance: a round closes within seconds
    while client.get_experiment(NAME)["round"]["index"] <= round_index:
        assert time.monotonic() < deadline, f"no round after {round_index} started within 60 s"
        time.sleep(0.1)


def make_writers() -> list[StatisticsWriter]:
    rng = np.random.default_rng(SEED)
    n_resent = round(RESEND_SHARE * BATCHES_PER_WRITER)
    writers = []
    conflict_writers = set(rng.choice(WRITERS, size=CONFLICTS, replace=False).tolist())
    for index in range(WRITERS):
        chosen = rng.choice(BATCHES_PER_WRITER, size=n_resent + 1, replace=False).tolist()
        conflicting = frozenset(chosen[-1:]) if index in conflict_writers else frozenset()
        writers.append(StatisticsWriter(index, resent=frozenset(chosen[:n_resent]), conflicting=conflicting))
    return writers


def send_and_check(base_url: str, engine: sa.Engine) -> None:
    create_experiment(base_url, round_seconds=1)
    writers = make_writers()
    with ThreadPoolExecutor(WRITERS) as pool:
        for future in [pool.submit(writer.run, base_url) for writer in writers]:
            future.result()

    answers: dict[str, list[tuple[int, bool | None]]] = defaultdict(list)
    for writer in writers:
        for batch_id, status, duplicate in writer.answers:
            answers[batch_id].append((status, duplicate))
    resent = {f"w{w.index}-b{b}" for w in writers for b in w.resent}
    conflicting = {f"w{w.index}-b{b}" for w in writers for b in w.conflicting}
    assert len(resent) == WRITERS * round(RESEND_SHARE * BATCHES_PER_WRITER) and len(conflicting) == CONFLICTS
    assert len(answers) == WRITERS * BATCHES_PER_WRITER
    for batch_id, statuses in answers.items():
        if batch_id in resent:
            assert sorted(statuses) == [(200, True), (202, False)], (batch_id, statuses)
        elif batch_id in conflicting:
            assert sorted(status for status, _ in statuses) == [202, 409], (batch_id, statuses)
        else:
            assert statuses == [(202, False)], (batch_id, statuses)

    applied = [batch for writer in writers for batch in writer.applied]
    assert len(applied) == len(answers)  # one applied version per batch id
    expected: dict[tuple, list] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    expected_counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    arm_position = {arm: position for position, arm in enumerate(ARMS)}
    metric_position = {metric: position for position, metric in enumerate(METRICS)}
    for batch in applied:
        largest: dict[tuple, int] = defaultdict(int)
        for cell in batch["cells"]:
            key = (cell["round"], arm_position[cell["arm"]], metric_position[cell["metric"]])
            totals = expected[key]
            totals[0] += cell["count"]
            totals[1] += cell["sum"]
            totals[2] += cell["sum_of_squares"]
            totals[3] += abs(cell["sum"])
            pair = key[:2]
            largest[pair] = max(largest[pair], cell["count"])
        for pair, count in largest.items():
            expected_counts[pair][0] += count
        for entry in batch["units"]:
            expected_counts[(entry["round"], arm_position[entry["arm"]])][1] += entry["units"]

    with engine.connect() as connection:
        (experiment_id,) = connection.execute(sa.select(Experiment.id).where(Experiment.name == NAME)).one()
        rows = connection.execute(
            sa.select(RoundStatistic.round_index, RoundStatistic.arm_index, RoundStatistic.metric_index,
                      RoundStatistic.count, RoundStatistic.sum, RoundStatistic.sum_of_squares)
            .where(RoundStatistic.experiment_id == experiment_id)).all()
        counts = connection.execute(
            sa.select(ArmRoundCount.round_index, ArmRoundCount.arm_index, ArmRoundCount.observations,
                      ArmRoundCount.units)
            .where(ArmRoundCount.experiment_id == experiment_id)).all()
        batches = connection.execute(sa.select(sa.func.count()).select_from(StatisticsBatch)
                                     .where(StatisticsBatch.experiment_id == experiment_id)).scalar_one()
    assert batches == len(answers)
    stored = {(r, a, m): (count, total, squares) for r, a, m, count, total, squares in rows}
    assert stored.keys() == expected.keys()
    assert len({key[0] for key in stored}) >= 2, "every writer sends its second half to a later round"
    for key, (count, total, squares) in stored.items():
        want_count, want_sum, want_squares, magnitude = expected[key]
        assert count == want_count, key
        assert abs(total - want_sum) <= 1e-9 * max(1.0, magnitude), (key, total, want_sum)
        assert abs(squares - want_squares) <= 1e-9 * max(1.0, want_squares), (key, squares, want_squares)
    assert {(r, a): [observations, units] for r, a, observations, units in counts} == dict(expected_counts)
    assert_round_counts_match(engine)  # and their per-round sums, kept in the batches' transactions


def test_sqlite_pasto_serve_applies_concurrent_statistics_batches_once(migrated_sqlite, service_processes,
                                                                       inspect_engine):
    server = service_processes.serve(migrated_sqlite, threads=8, scheduler=True, scheduler_interval=0.2)
    send_and_check(server.url, inspect_engine(migrated_sqlite))


@pytest.mark.postgres
def test_gunicorn_and_pasto_worker_apply_concurrent_statistics_batches_once(migrated_postgres, service_processes,
                                                                           inspect_engine):
    web = service_processes.gunicorn(migrated_postgres, workers=4, wait=False)
    scheduler = service_processes.worker(migrated_postgres, scheduler_interval=0.2, wait=False)
    web.wait_healthy()
    scheduler.wait_scheduling()
    send_and_check(web.url, inspect_engine(migrated_postgres))
