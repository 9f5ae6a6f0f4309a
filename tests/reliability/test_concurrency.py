"""Concurrent writers through real server processes: every observation counted exactly once.

8 writers send 10,000 observations each (batches of 250, the sticky arm of each unit asked from
``POST .../assign`` first); 10% of the batches are sent twice at the same time from two connections,
with the same ids. The experiment's rounds last 1 s and a scheduler closes them while the writers
run, so assignment, on-time and late ingestion and round closes all interleave.

* SQLite: one ``pasto serve`` process (waitress, 8 threads, its own scheduler).
* PostgreSQL: ``gunicorn -w 4 -b 127.0.0.1:PORT service.wsgi:app`` plus one ``pasto worker``: the
  documented multi-process deployment.

Each test proves:

* per round and arm, the counts, distinct units and float sums in ``round_statistics`` /
  ``arm_round_counts`` and the counts, units and means of ``GET .../rounds`` equal those of the
  observations sent, each id once, computed independently with numpy (counts exactly, sums to 1e-9);
* the 202 answers report every id accepted exactly once and every second copy as duplicates; no
  request failed (the client raises on any 4xx/5xx);
* the rounds form one unbroken chain, every closed round applied once (settle time 0).

The gunicorn test also proves that all 4 workers served the writers (no worker died or was
replaced), that every worker assigns each unit the same arm within a round (the arm
``pasto.hashing`` gives from the round's stored propensities), and that a round closed by
``pasto worker`` is served by every one of the 4 workers once it is committed (the per-process
cache checks the experiment's version at most ``PASTO_VERSION_CHECK_SECONDS`` = 0.05 s late).

(The offline replay of the updates is checked in test_crash.py and test_schedulers.py, where no
observation arrives after its round's update; here late observations are expected and enter later
updates, so the final statistics are not what each update saw.)
"""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import sqlalchemy as sa

from pasto_client import Client
from pasto.hashing import buckets, choose_arms
from service.models import Experiment, Round
from tests.reliability.harness import (
    ADMIN_TOKEN, ARMS, NAME, Writer, assert_api_rounds_match, assert_round_chain, assert_same_statistics,
    create_experiment, expected_statistics, run_writers, stored_statistics, unique_observations,
)

WRITERS = 8
OBSERVATIONS_PER_WRITER = 10_000
BATCH_SIZE = 250
RESEND_SHARE = 0.1
SEED = 20240611
EXPERIMENT_SEED = 7
GUNICORN_WORKERS = 4


def send_and_check_counts(base_url: str, engine: sa.Engine) -> None:
    """Run the writers against ``base_url`` and check the answers, the API and the tables."""
    create_experiment(base_url, round_seconds=1, seed=EXPERIMENT_SEED)
    writers = [Writer(index, seed=SEED, n_batches=OBSERVATIONS_PER_WRITER // BATCH_SIZE, batch_size=BATCH_SIZE,
                      resend_share=RESEND_SHARE) for index in range(WRITERS)]
    run_writers(writers, base_url)
    assert all(writer.finished for writer in writers)

    observations = unique_observations(writers)
    assert len(observations) == WRITERS * OBSERVATIONS_PER_WRITER
    answers = [answer for writer in writers for batch in writer.answers.values() for answer in batch]
    resent = sum(len(writer.built[index].observations) for writer in writers for index in writer.resent)
    assert resent == WRITERS * round(RESEND_SHARE * OBSERVATIONS_PER_WRITER / BATCH_SIZE) * BATCH_SIZE
    assert sum(answer["accepted"] for answer in answers) == len(observations)
    assert sum(answer["duplicates"] for answer in answers) == resent

    n_rounds = max(observation["round"] for observation in observations) + 1
    assert n_rounds >= 2, "the writers should have outlived at least one 1-second round"
    expected = expected_statistics(observations, n_rounds)
    with Client(base_url, ADMIN_TOKEN, timeout=60) as client:
        assert_api_rounds_match(client, expected)
    assert_same_statistics(expected, stored_statistics(engine, n_rounds))


def test_sqlite_pasto_serve_counts_concurrent_writers_once(migrated_sqlite, service_processes, inspect_engine):
    server = service_processes.serve(migrated_sqlite, threads=8, scheduler=True, scheduler_interval=0.2)
    engine = inspect_engine(migrated_sqlite)
    send_and_check_counts(server.url, engine)
    assert server.stop() == 0
    assert "Traceback" not in server.log(), server.log()[-4000:]
    assert_round_chain(engine)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"


# ------------------------------------------------------------------------------------ gunicorn
def child_pids(parent: int) -> set[int]:
    """Pids of the live processes whose parent is ``parent`` (gunicorn's workers of its master)."""
    children = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name "(...)", which may itself contain spaces: state, ppid, ...
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            children.add(int(entry.name))
    return children


_ACCESS_LINE = re.compile(r"^<(?P<pid>\d+)> (?P<method>\S+) (?P<path>\S+) (?P<query>\S*) (?P<status>\d{3}) (?P<microseconds>\d+)$")


def access_log(path: Path) -> list[dict[str, str]]:
    lines = [_ACCESS_LINE.match(line) for line in path.read_text().splitlines()]
    assert all(lines), "unexpected access log line"
    return [line.groupdict() for line in lines]


PROBE_UNITS = [f"probe-u{i}" for i in range(64)]


def probe_assignment(base_url: str) -> tuple[str, dict]:
    """One ``POST .../assign`` of :data:`PROBE_UNITS` on a connection of its own; its ``probe`` query
    parameter finds the request in the access log (and with it the worker that answered)."""
    probe = uuid.uuid4().hex
    response = requests.post(f"{base_url}/api/v1/experiments/{NAME}/assign?probe={probe}",
                             json={"units": PROBE_UNITS}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                             timeout=60)
    assert response.status_code == 200, response.text
    assignments = response.json()["assignments"]
    rounds = {item["round"] for item in assignments}
    assert len(rounds) == 1
    return probe, {"round": rounds.pop(), "arms": [item["arm"] for item in assignments]}


def current_round(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(sa.select(Experiment.round_index).where(Experiment.name == NAME)).scalar_one()


def round_probabilities(engine: sa.Engine, index: int) -> np.ndarray:
    with engine.connect() as connection:
        probabilities = connection.execute(
            sa.select(Round.probabilities).join(Experiment, Experiment.id == Round.experiment_id)
            .where(Experiment.name == NAME, Round.index == index)).scalar_one()
    return np.asarray(probabilities, dtype=np.float64)


def assert_every_worker_serves_the_new_round(base_url: str, engine: sa.Engine, access_log_path: Path,
                                             worker_pids: set[int]) -> None:
    """Wait for `pasto worker` to close a round, then probe until each gunicorn worker has answered:
    every answer is in that round or a later one, and in one round every worker assigns alike."""
    before = current_round(engine)
    # Hang guard, not a tolerance: with 0.2 s scheduler ticks and short rounds a close comes within seconds; 20 s
    # covers a 2-core machine running two suites.
    deadline = time.monotonic() + 20
    while (opened := current_round(engine)) == before:
        assert time.monotonic() < deadline, "pasto worker closed no round in 20 s"
        time.sleep(0.05)
    # Longer than PASTO_VERSION_CHECK_SECONDS (0.05): every worker's cached version is now re-checked.
    # A lower bound, 3x the check interval: a slower machine only waits longer, which changes nothing.
    time.sleep(0.15)
    answers: dict[str, dict] = {}
    with ThreadPoolExecutor(8) as pool:
        for _ in range(40):  # 8 concurrent probes a time, up to 320 in all
            answers.update(pool.map(lambda _: probe_assignment(base_url), range(8)))
            served = {int(line["pid"]) for line in access_log(access_log_path)
                      if line["query"].removeprefix("probe=") in answers}
            if served >= worker_pids:
                break
    assert served == worker_pids, f"only workers {served} of {worker_pids} answered the probes"
    by_round: dict[int, set[tuple[str, ...]]] = {}
    for answer in answers.values():
        assert answer["round"] >= opened, f"a worker served round {answer['round']} after round {opened} opened"
        by_round.setdefault(answer["round"], set()).add(tuple(answer["arms"]))
    for index, arm_lists in by_round.items():
        assert len(arm_lists) == 1, f"workers disagree on the arms of round {index}"
        hashed = choose_arms(round_probabilities(engine, index), buckets(EXPERIMENT_SEED, PROBE_UNITS, index))
        assert arm_lists.pop() == tuple(ARMS[arm] for arm in hashed.tolist())


@pytest.mark.postgres
def test_gunicorn_four_workers_and_pasto_worker_count_concurrent_writers_once(
        migrated_postgres, service_processes, inspect_engine):
    # Both start at once: importing the application in five interpreters is most of the start-up time.
    web = service_processes.gunicorn(migrated_postgres, workers=GUNICORN_WORKERS, wait=False)
    scheduler = service_processes.worker(migrated_postgres, scheduler_interval=0.2, wait=False)
    web.wait_healthy()
    scheduler.wait_scheduling()
    engine = inspect_engine(migrated_postgres)
    worker_pids = child_pids(web.pid)
    assert len(worker_pids) == GUNICORN_WORKERS

    send_and_check_counts(web.url, engine)
    # The writers' requests reached every worker, and no worker died or was replaced on the way.
    lines = access_log(web.access_log)
    assert {int(line["pid"]) for line in lines} == worker_pids
    assert not [line for line in lines if line["status"].startswith("5")]

    for _ in range(2):  # two closes by pasto worker, each seen by all four web workers
        assert_every_worker_serves_the_new_round(web.url, engine, web.access_log, worker_pids)
    assert child_pids(web.pid) == worker_pids

    assert scheduler.stop() == 0
    assert "Traceback" not in scheduler.log() + web.log(), (scheduler.log() + web.log())[-4000:]
    stored = assert_round_chain(engine)
    assert stored.experiment.round_index >= 3
