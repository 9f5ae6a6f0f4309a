"""Two ``pasto worker`` processes against one PostgreSQL database close every round exactly once.

A 1-second-round experiment is created, paused at once, given data in round 0 and resumed (so none of
the data can arrive after its round's update, whatever the schedulers do), and two workers with
``PASTO_SCHEDULER_INTERVAL=0.2`` race to close its rounds for 20 rounds. Closing is a compare-and-set
on the experiment row, so the test proves, with both schedulers alive the whole time (a heartbeat row
each):

* one ``rounds`` row per index, each closed round's ``closed_at`` the next round's ``started_at``
  (no gap, no overlap), and ``applied_rounds`` equal to the number of closed rounds;
* the two workers' logs together announce each closed round exactly once;
* the offline replay of ``pasto.algorithm.update`` over the stored statistics and propensities,
  each closed round once, equals the stored controller state (and applying any round twice would
  not: the replay's negative control).
"""

from __future__ import annotations

import re
import signal
from collections import Counter

import numpy as np
import pytest
import sqlalchemy as sa

from service.db import get_db
from service.models import Experiment, SchedulerHeartbeat
from tests.reliability.harness import (
    ADMIN_TOKEN, NAME, assert_replay_matches, assert_round_chain, experiment_body, replay, wait_until,
)
from tests.service.conftest import make_app

ROUNDS = 20
SCHEDULER_INTERVAL = 0.2
CLOSED = re.compile(rf"Experiment {NAME}: closed round (\d+), applied \[(\d+)\], now serving round (\d+)")


def create_with_round_zero_data(database_url: str) -> None:
    """The experiment and 2,000 observations of round 0, through the API in this process.

    Paused while the data goes in: no scheduler can close round 0 before all of it is stored.
    """
    app = make_app(database_url)
    try:
        client = app.test_client()
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        created = client.post("/api/v1/experiments", json=experiment_body(round_seconds=1, seed=5), headers=headers)
        assert created.status_code == 201, created.get_json()
        paused = client.post(f"/api/v1/experiments/{NAME}/pause", headers=headers).get_json()
        assert (paused["status"], paused["round"]["index"]) == ("paused", 0), "paused more than 1 s after creation"
        rng = np.random.default_rng(3)
        values = rng.normal(size=(2000, 2)).tolist()
        observations = [{"id": f"o{i}", "unit": f"u{i % 700}", "round": 0, "values": {"x": x, "y": y}}
                        for i, (x, y) in enumerate(values)]
        answer = client.post(f"/api/v1/experiments/{NAME}/observations", json={"observations": observations},
                             headers=headers)
        assert answer.status_code == 202 and answer.get_json() == {"accepted": 2000, "duplicates": 0}
        resumed = client.post(f"/api/v1/experiments/{NAME}/resume", headers=headers).get_json()
        assert (resumed["status"], resumed["round"]["index"]) == ("running", 0)
    finally:
        get_db(app).engine.dispose()


@pytest.mark.postgres
def test_two_workers_close_every_round_exactly_once(migrated_postgres, service_processes, inspect_engine):
    engine = inspect_engine(migrated_postgres)
    # The workers start (importing the service takes seconds) while the experiment is being set up.
    workers = [service_processes.worker(migrated_postgres, scheduler_interval=SCHEDULER_INTERVAL, wait=False)
               for _ in range(2)]
    create_with_round_zero_data(migrated_postgres)
    for worker in workers:
        worker.wait_scheduling()

    def applied_rounds() -> int:
        with engine.connect() as connection:
            return connection.execute(sa.select(Experiment.applied_rounds).where(Experiment.name == NAME)).scalar_one()

    wait_until(lambda: applied_rounds() >= ROUNDS, 2 * ROUNDS + 20, f"fewer than {ROUNDS} rounds closed", 0.2)
    for worker in workers:  # both at once, so neither goes on closing rounds alone for long
        worker.signal_group(signal.SIGTERM)
    for worker in workers:
        assert worker.stop() == 0
    logs = [worker.log() for worker in workers]
    assert not any("Traceback" in log for log in logs), logs

    stored = assert_round_chain(engine)
    closed = stored.experiment.round_index
    assert closed >= ROUNDS
    assert sum(row.closed_at is not None for row in stored.rounds) == closed == stored.experiment.applied_rounds
    announcements = Counter()
    for log in logs:
        for match in CLOSED.finditer(log):
            closed_round, applied, serving = (int(group) for group in match.groups())
            assert applied == closed_round and serving == closed_round + 1
            announcements[closed_round] += 1
    assert announcements == Counter(range(closed)), "each round announced once, by one worker or the other"
    with engine.connect() as connection:
        assert connection.execute(sa.select(sa.func.count()).select_from(SchedulerHeartbeat)).scalar_one() == 2

    assert_replay_matches(engine)
    assert replay(engine, apply_twice=closed // 2)[1], "the replay must notice a round applied twice"
