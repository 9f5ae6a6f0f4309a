"""``kill -9`` of the server in the middle of ingestion and in the middle of a round update.

The client's rule is the one ``pasto_client`` documents: a request whose answer did not arrive is
sent again, unchanged (same observation ids, same ``{"round": r}``), once a server is up again.
After the crash, a restart and those retries, each test proves that nothing was lost, nothing was
counted twice (per round and arm counts, distinct units and sums equal those of the observations
sent, each id once) and every round was applied exactly once (one ``rounds`` row per index, an
unbroken chain, and an offline replay of ``pasto.algorithm.update`` over the stored statistics and
propensities equal to the stored controller state).

The kills are not left to luck; each test first makes sure the server is inside an open write
transaction, then kills it:

* PostgreSQL, ingestion: the test holds ``LOCK TABLE round_statistics IN EXCLUSIVE MODE``. Ingestion
  transactions insert their observation ids, then wait for the lock to add the statistics;
  ``pg_stat_activity`` shows them waiting with a transaction id (they have written). The server is
  killed there, the lock released, the orphaned backends end, the server restarts, the writers
  re-send: the ids of the killed transactions must not count as seen.
* PostgreSQL, round update: the test holds ``LOCK TABLE rounds IN EXCLUSIVE MODE`` (reads pass,
  writes wait) and asks for a close; the close transaction locks the experiment row, reads the
  statistics, runs the update and waits to write the round's ``applied_at``. Killed there, the round
  must still be open after the restart, and the retried close applies it once.
* SQLite: a transaction cannot be held open from outside, so the server is frozen (SIGSTOP) at a
  moment when the database's write lock is taken (``BEGIN IMMEDIATE`` from the test fails), checked
  still to hold it while frozen (and, for the round update, that the round has not been committed as
  closed), then killed. The database must pass ``PRAGMA integrity_check`` after the crash.
"""

from __future__ import annotations

import re
import sqlite3
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from pasto_client import Client, PastoAPIError, PastoConnectionError
from tests.reliability.harness import (
    ADMIN_TOKEN, NAME, InFlight, Writer, assert_api_rounds_match, assert_replay_matches, assert_round_chain,
    assert_same_statistics, create_experiment, expected_statistics, replay, run_writers, stored_rounds,
    stored_statistics, unique_observations, wait_until,
)

SEED = 97
STREAM_WRITERS = 4
STREAM_BATCHES = 20
STREAM_BATCH_SIZE = 200
#: Batches acknowledged before the crash: the kill hits a stream that is well under way.
ACKNOWLEDGED_BEFORE_CRASH = 8


# ------------------------------------------------------------------------------------ helpers
def sqlite_path(url: str) -> str:
    return sa.engine.make_url(url).database


class SQLiteWriteLock:
    """Tells whether some connection holds the write lock of a SQLite database, without waiting."""

    def __init__(self, url: str) -> None:
        self.connection = sqlite3.connect(sqlite_path(url), timeout=0, isolation_level=None)

    def held(self) -> bool:
        try:
            self.connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as error:
            if "locked" in str(error) or "busy" in str(error):
                return True
            raise
        self.connection.execute("ROLLBACK")
        return False

    def round_index(self) -> int:
        """The experiment's round index as last committed (WAL: readers never wait for the writer)."""
        return self.connection.execute("SELECT round_index FROM experiments WHERE name = ?", (NAME,)).fetchone()[0]

    def close(self) -> None:
        self.connection.close()


def freeze_inside_write_transaction(server, lock: SQLiteWriteLock, inside, until: Future,
                                    seconds: float = 60) -> bool:
    """Freeze ``server`` while it holds the write lock and ``inside()`` is true.

    Polls the lock; when it is taken, freezes the server and checks again, now that nothing can move:
    returns True with the server frozen inside its transaction, or thaws it and keeps polling. Returns
    False (server running) once ``until`` is done, e.g. the request finished before it could be caught.
    """
    # Hang guard, not a tolerance: the write lock is taken within a second of the stream starting; `seconds` (60)
    # only ends a failing run.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if until.done():
            return False
        if lock.held():
            server.freeze()  # returns once every thread has stopped
            if lock.held() and inside():
                return True
            server.thaw()
        time.sleep(0.0005)
    raise AssertionError(f"the server never held the write lock in {seconds} s")


def assert_sqlite_intact(url: str) -> None:
    connection = sqlite3.connect(sqlite_path(url))
    try:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        connection.close()


def waiting_on_lock(engine: sa.Engine, at_least: int = 1) -> list:
    """Backends of this database waiting for a heavyweight lock, (pid, xid, query) each; an empty list
    while fewer than ``at_least`` are."""
    with engine.connect() as connection:
        rows = connection.execute(sa.text(
            "SELECT pid, backend_xid::text AS xid, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
        )).all()
    return rows if len(rows) >= at_least else []


def wait_for_backends_to_end(engine: sa.Engine, pids: set[int]) -> None:
    """The orphans of a killed server notice the closed connection and roll back; wait for that."""
    def gone() -> bool:
        with engine.connect() as connection:
            alive = connection.execute(sa.text("SELECT pid FROM pg_stat_activity WHERE pid = ANY(:pids)"),
                                       {"pids": list(pids)}).scalars().all()
        return not alive
    wait_until(gone, 30, f"backends {pids} of the killed server did not end")


def stream_writers() -> list[Writer]:
    return [Writer(index, seed=SEED, n_batches=STREAM_BATCHES, batch_size=STREAM_BATCH_SIZE)
            for index in range(STREAM_WRITERS)]


def assert_counted_once(base_url: str, engine: sa.Engine, writers: list[Writer]) -> None:
    observations = unique_observations(writers)
    assert len(observations) == STREAM_WRITERS * STREAM_BATCHES * STREAM_BATCH_SIZE
    n_rounds = max(observation["round"] for observation in observations) + 1
    expected = expected_statistics(observations, n_rounds)
    assert_same_statistics(expected, stored_statistics(engine, n_rounds))
    with Client(base_url, ADMIN_TOKEN, timeout=60) as client:
        assert_api_rounds_match(client, expected)


def close_rounds_and_replay(base_url: str, engine: sa.Engine, count: int) -> None:
    """Close ``count`` rounds by hand, then: one row per round, each applied once (replay)."""
    with Client(base_url, ADMIN_TOKEN, timeout=60) as client:
        for _ in range(count):
            index = client.get_experiment(NAME)["round"]["index"]
            assert client.close_round(NAME, index)["applied"] == [index]
    assert_round_chain(engine)
    assert_replay_matches(engine)


# ------------------------------------------------------------------------------------ ingestion
def test_sqlite_kill_during_ingestion_loses_and_doubles_nothing(migrated_sqlite, service_processes, inspect_engine):
    engine = inspect_engine(migrated_sqlite)
    server = service_processes.serve(migrated_sqlite, threads=4)
    create_experiment(server.url, round_seconds=3600, seed=11)
    writers = stream_writers()
    in_flight = InFlight()
    lock = SQLiteWriteLock(migrated_sqlite)
    with ThreadPoolExecutor(1) as background:
        stream = background.submit(run_writers, writers, server.url, in_flight)
        wait_until(lambda: in_flight.answered >= ACKNOWLEDGED_BEFORE_CRASH or stream.done(), 60,
                   "the writers made no progress")
        try:
            frozen = freeze_inside_write_transaction(server, lock, lambda: in_flight.count >= 2, stream)
            assert frozen, "the stream ended before the server could be caught inside a transaction"
            batches_in_flight = in_flight.count
            server.kill9()
        finally:
            lock.close()
        stream.result()  # every writer stops at its first unanswered request
    assert batches_in_flight >= 2
    # At least the batch whose transaction held the lock got no answer (a response follows the commit).
    assert sum(len(writer.unacknowledged) for writer in writers) >= 1
    assert not all(writer.finished for writer in writers)
    assert_sqlite_intact(migrated_sqlite)

    restarted = service_processes.serve(migrated_sqlite, threads=4)
    run_writers(writers, restarted.url)  # re-sends the unacknowledged batches first, then the rest
    assert all(writer.finished for writer in writers)
    assert_counted_once(restarted.url, engine, writers)
    close_rounds_and_replay(restarted.url, engine, count=2)
    assert_sqlite_intact(migrated_sqlite)


@pytest.mark.postgres
def test_postgres_kill_during_ingestion_loses_and_doubles_nothing(migrated_postgres, service_processes,
                                                                  inspect_engine):
    engine = inspect_engine(migrated_postgres)
    server = service_processes.serve(migrated_postgres, threads=4)
    create_experiment(server.url, round_seconds=3600, seed=11)
    writers = stream_writers()
    in_flight = InFlight()
    with ThreadPoolExecutor(1) as background, engine.connect() as locker:
        stream = background.submit(run_writers, writers, server.url, in_flight)
        wait_until(lambda: in_flight.answered >= ACKNOWLEDGED_BEFORE_CRASH or stream.done(), 60,
                   "the writers made no progress")
        assert not stream.done()
        locker.begin()
        locker.exec_driver_sql("LOCK TABLE round_statistics IN EXCLUSIVE MODE")
        # Every writer's next batch: ids inserted, then waiting to add its statistics.
        blocked = wait_until(lambda: waiting_on_lock(engine, at_least=STREAM_WRITERS), 60,
                             "the ingestion transactions did not reach the locked table")
        assert all(row.xid is not None and "round_statistics" in row.query for row in blocked), blocked
        assert in_flight.count == STREAM_WRITERS
        server.kill9()
        locker.rollback()
        stream.result()
    wait_for_backends_to_end(engine, {row.pid for row in blocked})
    assert sum(len(writer.unacknowledged) for writer in writers) == STREAM_WRITERS

    restarted = service_processes.serve(migrated_postgres, threads=4)
    run_writers(writers, restarted.url)
    assert all(writer.finished for writer in writers)
    # The batches killed half-way were accepted in full when re-sent: their ids had not been kept.
    for writer in writers:
        assert all(answers == [{"accepted": STREAM_BATCH_SIZE, "duplicates": 0}]
                   for answers in writer.answers.values())
    assert_counted_once(restarted.url, engine, writers)
    close_rounds_and_replay(restarted.url, engine, count=2)


# ------------------------------------------------------------------------------------ round update
def ingest_one_batch(base_url: str, writer_index: int) -> Writer:
    writer = Writer(writer_index, seed=SEED, n_batches=1, batch_size=100)
    writer.run(base_url)
    assert writer.finished
    return writer


def close_in_background(pool: ThreadPoolExecutor, base_url: str, index: int) -> Future:
    def close() -> dict:
        with Client(base_url, ADMIN_TOKEN, timeout=120) as client:
            return client.close_round(NAME, index)
    return pool.submit(close)


def assert_round_still_open(engine: sa.Engine, before) -> None:
    """The killed close left no trace: experiment row and rounds exactly as before it."""
    after = stored_rounds(engine)
    assert after.experiment == before.experiment
    assert after.rounds == before.rounds
    assert after.rounds[-1].closed_at is None


def retry_close(base_url: str, index: int) -> None:
    """The client's retry of the unanswered close: applied now, once; a second retry is refused."""
    with Client(base_url, ADMIN_TOKEN, timeout=60) as client:
        closed = client.close_round(NAME, index)
        assert (closed["closed_round"], closed["applied"], closed["round"]["index"]) == (index, [index], index + 1)
        with pytest.raises(PastoAPIError) as refused:
            client.close_round(NAME, index)
        assert refused.value.status == 409


@pytest.mark.postgres
def test_postgres_kill_during_round_update_applies_it_once(migrated_postgres, service_processes, inspect_engine):
    engine = inspect_engine(migrated_postgres)
    server = service_processes.serve(migrated_postgres, threads=4)
    create_experiment(server.url, round_seconds=3600, seed=11)
    writers = [ingest_one_batch(server.url, 0)]
    with Client(server.url, ADMIN_TOKEN, timeout=60) as client:
        assert client.close_round(NAME, 0)["applied"] == [0]
    writers.append(ingest_one_batch(server.url, 1))  # round 1, the one whose update is killed
    before = stored_rounds(engine)
    assert before.experiment.round_index == 1

    with ThreadPoolExecutor(1) as background, engine.connect() as locker:
        locker.begin()
        locker.exec_driver_sql("LOCK TABLE rounds IN EXCLUSIVE MODE")
        close = close_in_background(background, server.url, 1)
        blocked = wait_until(lambda: waiting_on_lock(engine), 60, "the close did not reach the locked table")
        # The update has run; the transaction waits to write a round (it holds the experiment row).
        assert len(blocked) == 1, blocked
        assert re.match(r"\s*(UPDATE|INSERT INTO)\s+\"?rounds\b", blocked[0].query, re.IGNORECASE), blocked
        server.kill9()
        locker.rollback()
        with pytest.raises(PastoConnectionError):
            close.result()
    wait_for_backends_to_end(engine, {blocked[0].pid})
    assert_round_still_open(engine, before)

    restarted = service_processes.serve(migrated_postgres, threads=4)
    retry_close(restarted.url, 1)
    observations = unique_observations(writers)
    expected = expected_statistics(observations, 2)
    assert_same_statistics(expected, stored_statistics(engine, 2))
    close_rounds_and_replay(restarted.url, engine, count=1)


def test_sqlite_kill_during_round_update_applies_it_once(migrated_sqlite, service_processes, inspect_engine):
    engine = inspect_engine(migrated_sqlite)
    server = service_processes.serve(migrated_sqlite, threads=4)
    create_experiment(server.url, round_seconds=3600, seed=11)
    lock = SQLiteWriteLock(migrated_sqlite)
    writers: list[Writer] = []
    caught = None
    try:
        # A close takes milliseconds: try round after round until one is caught inside its transaction.
        for index in range(20):
            writers.append(ingest_one_batch(server.url, index))
            before = stored_rounds(engine)
            assert before.experiment.round_index == index
            with ThreadPoolExecutor(1) as background:
                close = close_in_background(background, server.url, index)
                if freeze_inside_write_transaction(server, lock, lambda: lock.round_index() == index, close):
                    caught = index
                    server.kill9()
                    with pytest.raises(PastoConnectionError):
                        close.result()
                    break
                assert close.result()["applied"] == [index]
    finally:
        lock.close()
    assert caught is not None, "no close was caught inside its transaction in 20 rounds"
    assert_sqlite_intact(migrated_sqlite)
    assert_round_still_open(engine, before)

    restarted = service_processes.serve(migrated_sqlite, threads=4)
    retry_close(restarted.url, caught)
    observations = unique_observations(writers)
    assert_same_statistics(expected_statistics(observations, caught + 1), stored_statistics(engine, caught + 1))
    close_rounds_and_replay(restarted.url, engine, count=1)
    # The replay can tell: applying the killed round's update twice gives another state.
    assert replay(engine, apply_twice=caught)[1]
    assert_sqlite_intact(migrated_sqlite)


# ------------------------------------------------------------------ kills during closes: summaries
#: Crashes per process kind: the issue's acceptance (10 kills of each during closes).
CLOSE_KILLS = 10
#: Arms of the experiment killed during its closes: a summary (the exact optimum behind its regret)
#: then takes a good part of each close, so kills land between a close's commit and its summary.
SUMMARY_ARMS = 200


def _unsummarized(engine: sa.Engine) -> int:
    """Applied rounds of the experiment without a summary."""
    with engine.connect() as connection:
        return connection.execute(sa.text(
            "SELECT count(*) FROM rounds WHERE applied_at IS NOT NULL AND summary IS NULL")).scalar_one()


def _applied(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(sa.text("SELECT applied_rounds FROM experiments")).scalar_one()


@pytest.mark.postgres
@pytest.mark.parametrize("killed", ["serve", "gunicorn", "worker"])
def test_kills_during_closes_leave_every_applied_round_summarized(killed, migrated_postgres, service_processes,
                                                                  inspect_engine):
    """kill -9, 10 times, of the process closing rounds (``pasto serve`` with its scheduler, ``pasto
    worker``) or answering an admin's closes (the gunicorn group), at random moments of 1-second rounds:
    after a restart every applied round has its summary (the next tick stores those a kill lost), and
    the cumulative regret counts every round."""
    import random

    url = migrated_postgres
    engine = inspect_engine(url)
    api = service_processes.serve(url)  # reads and the admin's closes when gunicorn is killed
    arms = [{"name": f"arm{k}", "params": {}} for k in range(SUMMARY_ARMS)]
    with Client(api.url, ADMIN_TOKEN, timeout=60) as client:
        client.create_experiment(name=NAME, arms=arms, metrics=["x"], objective={"primary": "x"}, round_seconds=1,
                                 seed=SEED)
        # Data in round 0 (no scheduler runs yet), so that every round's estimate and regret are
        # defined: a round with no observation at all has a null regret.
        client.observe(NAME, [{"id": f"o{i}", "unit": f"u{i}", "round": 0, "values": {"x": float(i % 7)}}
                              for i in range(1000)])
    rng = random.Random(SEED)  # how long a kill waits for a close's summary window at most
    lost_at_kills = []
    for _ in range(CLOSE_KILLS):
        if killed == "serve":
            process = service_processes.serve(url, scheduler=True)
        elif killed == "worker":
            process = service_processes.worker(url)
        else:
            process = service_processes.gunicorn(url, workers=2)
        applied = _applied(engine)
        closing = None
        if killed == "gunicorn":
            # An admin closes rounds through the gunicorn group as fast as it answers.
            pool = ThreadPoolExecutor(1)
            stop = [False]

            def close_repeatedly(base_url=process.url):
                with Client(base_url, ADMIN_TOKEN, timeout=10) as admin:
                    while not stop[0]:
                        try:
                            admin.close_round(NAME)
                        except (PastoAPIError, PastoConnectionError):
                            return

            closing = pool.submit(close_repeatedly)
        # Kill once a close has run since the start: the moment a close has committed and its summary
        # is not stored yet, when the polls see one (else at a random moment of the next second).
        wait_until(lambda: _applied(engine) > applied, 60, "no close after the start")
        deadline = time.monotonic() + rng.uniform(1.0, 3.0)
        while time.monotonic() < deadline and _unsummarized(engine) == 0:
            time.sleep(0.001)
        process.kill9()
        if closing is not None:
            stop[0] = True
            closing.result(timeout=30)
            pool.shutdown()
        lost_at_kills.append(_unsummarized(engine))
    # One scheduler again: its ticks store every summary a kill lost.
    repairer = service_processes.worker(url)
    wait_until(lambda: _unsummarized(engine) == 0, 60, "an applied round is still without a summary")
    repairer.stop()
    applied = _applied(engine)
    with Client(api.url, ADMIN_TOKEN, timeout=60) as client:
        diagnostics = client.diagnostics(NAME)
    assert len(diagnostics["regret"]["per_round"]) == applied, lost_at_kills
    assert all(value is not None for value in diagnostics["regret"]["per_round"])
    assert diagnostics["regret"]["cumulative"] == pytest.approx(sum(diagnostics["regret"]["per_round"]))
    print(f"{killed}: {CLOSE_KILLS} kills, {applied} rounds applied, rounds without a summary right after each "
          f"kill: {lost_at_kills}")
