"""``service.store``'s bulk statements: PostgreSQL array literals read back as exactly the values they were made from, and
``insert_new`` reports exactly the new rows, or with ``expect_new`` refuses as a whole."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.db import Database, make_engine
from service.store import KeysExist, _array_literal, insert_new
from service.models import ObservationId

texts = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
special = st.sampled_from(['"', "\\", '\\"', "{", "}", ",", " ", "NULL", "null", "", "a b", "é🙂", "%s", "'", "\t\n"])
columns = st.one_of(
    st.lists(texts | special, min_size=1, max_size=20).map(lambda values: ("text", values)),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=20).map(lambda values: ("bigint", values)),
    st.lists(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**53, 2**53), min_size=1,
             max_size=20).map(lambda values: ("double precision", values)),
)


@pytest.fixture(scope="module")
def pg_connection(postgres_server_url):
    engine = sa.create_engine(postgres_server_url)
    with engine.connect() as connection:
        yield connection.connection.driver_connection
    engine.dispose()


@pytest.mark.postgres
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(columns)
def test_array_literals_read_back_exactly(pg_connection, column):
    sql_type, values = column
    (read,) = pg_connection.execute(f"SELECT %s::{sql_type}[]", (_array_literal(tuple(values)),)).fetchone()
    assert read == [float(value) for value in values] if sql_type == "double precision" else read == values


COLUMNS = ("experiment_id", "client_id", "round_index", "arm_index")


@pytest.fixture
def database(backend_url):
    engine = make_engine(backend_url)
    ObservationId.__table__.create(engine)
    sessions = sa.orm.sessionmaker(bind=engine.execution_options(pasto_write=True))
    yield Database(engine=engine, read_sessions=sessions, write_sessions=sessions)
    engine.dispose()


def stored_ids(database: Database) -> list[str]:
    with database.engine.connect() as connection:
        return sorted(connection.execute(sa.select(ObservationId.client_id)).scalars())


def insert_ids(database: Database, client_ids: list[str], expect_new: bool) -> list[str]:
    with database.write() as session:
        inserted = insert_new(
            session.connection(), ObservationId.__table__, COLUMNS,
            [(1, client_id, 0, 0) for client_id in sorted(client_ids)], returning=("client_id",),
            expect_new=expect_new)
    return [client_id for (client_id,) in inserted]


def test_insert_new_returns_exactly_the_new_rows(database):
    assert insert_ids(database, ["a", "b"], expect_new=False) == ["a", "b"]
    assert insert_ids(database, ["b", "c", "d"], expect_new=False) == ["c", "d"]
    assert insert_ids(database, ["a", "d"], expect_new=False) == []
    assert stored_ids(database) == ["a", "b", "c", "d"]


def test_plain_insert_returns_every_row_or_refuses_as_a_whole(database):
    assert insert_ids(database, ["a", "zz"], expect_new=True) == ["a", "zz"]
    # 600 new ids sort before the existing "zz": on SQLite the first 500 go in an earlier statement,
    # and the rollback that KeysExist asks for takes them out again.
    new = [f"new-{i:03d}" for i in range(600)]
    with pytest.raises(KeysExist):
        insert_ids(database, [*new, "zz"], expect_new=True)
    assert stored_ids(database) == ["a", "zz"]
    assert insert_ids(database, [*new, "zz"], expect_new=False) == new


def waiting_for_a_lock(engine: sa.Engine) -> bool:
    """Whether a backend of this database (other than the asking one) waits for a heavyweight lock."""
    with engine.connect() as connection:
        return connection.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'")).scalar_one() > 0


@pytest.mark.postgres
@pytest.mark.parametrize("first_commits", [True, False])
def test_plain_insert_waits_for_a_concurrent_writer_of_the_same_id(postgres_url, first_commits):
    """A plain insert that meets another transaction's uncommitted row with the same key waits for it:
    if that commits, KeysExist (and the checked retry counts only the other row); if it rolls back,
    the plain insert succeeds."""
    engine = make_engine(postgres_url)
    ObservationId.__table__.create(engine)
    sessions = sa.orm.sessionmaker(bind=engine)
    database = Database(engine=engine, read_sessions=sessions, write_sessions=sessions)
    try:
        first = engine.connect()
        first_transaction = first.begin()
        first.execute(sa.insert(ObservationId), [{"experiment_id": 1, "client_id": "shared", "round_index": 0,
                                                  "arm_index": 0}])
        outcome: list = []

        def second_writer():
            try:
                outcome.append(insert_ids(database, ["other", "shared"], expect_new=True))
            except KeysExist:
                outcome.append("KeysExist")

        second = threading.Thread(target=second_writer)
        second.start()
        # Wait until PostgreSQL reports the second insert waiting for the first transaction's lock (a
        # fixed sleep let the first commit before the second had even started on a loaded machine,
        # which tested no wait at all). 30 s is a hang guard: it takes milliseconds.
        deadline = time.monotonic() + 30
        while not waiting_for_a_lock(engine):
            assert second.is_alive() and time.monotonic() < deadline, \
                "the second insert never waited for the uncommitted row"
            time.sleep(0.01)
        assert second.is_alive()  # blocked on the uncommitted "shared"
        if first_commits:
            first_transaction.commit()
        else:
            first_transaction.rollback()
        first.close()
        second.join(timeout=30)
        if first_commits:
            assert outcome == ["KeysExist"]
            assert stored_ids(database) == ["shared"]
            assert insert_ids(database, ["other", "shared"], expect_new=False) == ["other"]
        else:
            assert outcome == [["other", "shared"]]
        assert stored_ids(database) == ["other", "shared"]
    finally:
        engine.dispose()


def test_controller_state_arrays_are_stored_packed_and_read_back_bit_for_bit(app, api, setup_a):
    """The controller state's large arrays are stored as bytes inside the JSON document and read back
    as the same lists of the same floats (bit for bit), ints and bools; small lists, strings and
    documents written as plain JSON read as they are."""
    import json

    import numpy as np
    import sqlalchemy as sa

    from pasto.algorithm import AlgorithmConfig, initial_state
    from service.models import PACKED_MIN, Experiment, pack_arrays, unpack_arrays

    rng = np.random.default_rng(3)
    state = initial_state(AlgorithmConfig.from_preset("default"), 1000, 5).to_dict()
    state["log_weights"] = (rng.standard_normal(1000) * 1e-300).tolist()  # subnormals and signs
    state["extra"] = {"ints": list(range(PACKED_MIN)), "flags": [True, False] * PACKED_MIN,
                      "nested": rng.random((5, 1000)).tolist(), "short": [0.1, 0.2], "names": ["a"] * 300,
                      "mixed": [1, 2.5] * 200}
    packed = pack_arrays(state)
    assert packed["probabilities"]["$packed"] == "<f8" and packed["extra"]["short"] == [0.1, 0.2]
    assert packed["extra"]["names"] == ["a"] * 300
    restored = unpack_arrays(json.loads(json.dumps(packed)))
    expected = dict(state, extra=dict(state["extra"], mixed=[1.0, 2.5] * 200))  # one kind per list: floats
    assert restored == expected
    assert [type(x) for x in restored["extra"]["ints"][:2]] == [int, int]
    assert [type(x) for x in restored["extra"]["flags"][:2]] == [bool, bool]
    assert np.array_equal(np.asarray(restored["log_weights"]).view(np.int64),
                          np.asarray(state["log_weights"]).view(np.int64))
    plain = {"round_index": 1, "probabilities": [0.5] * 400}
    assert unpack_arrays(plain) == plain
    # Through the database: the column reads back the document that was written, packed in the row.
    from service.db import get_db

    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    with get_db(app).write() as session:
        experiment = session.execute(sa.select(Experiment).where(Experiment.name == "setup-a")).scalar_one()
        experiment.state = state
        experiment_id = experiment.id
    with get_db(app).read() as session:
        assert session.execute(sa.select(Experiment.state).where(Experiment.id == experiment_id)).scalar_one() == expected
        raw = session.execute(sa.text("SELECT state FROM experiments WHERE id = :i"), {"i": experiment_id}).scalar_one()
    assert '"$packed"' in (raw if isinstance(raw, str) else json.dumps(raw))
