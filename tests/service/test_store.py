"""``service.store``'s bulk statements: PostgreSQL array literals read back as exactly the values they were made from, and
``insert_new`` reports exactly the new rows, or with ``expect_new`` refuses as a whole."""

from __future__ import annotations

import dataclasses
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


def test_numpy_arrays_pack_as_the_lists_they_hold_and_the_state_with_arrays_packs_as_its_lists():
    """``pack_arrays`` of an array is ``pack_arrays`` of its list (large ones from their bytes, small ones
    as lists), and ``ControllerState.to_dict(arrays=True)`` packs to the very document ``to_dict()`` does."""
    import json

    import numpy as np

    from pasto.algorithm import AlgorithmConfig, initial_state
    from service.models import PACKED_MIN, pack_arrays, unpack_arrays

    rng = np.random.default_rng(5)
    for array in (rng.standard_normal((3, 5, 400)), rng.integers(-9, 9, PACKED_MIN), rng.random(PACKED_MIN) < 0.5,
                  rng.random(PACKED_MIN - 1), np.float64(2.5), np.arange(3, dtype=np.int32), np.zeros((2, 0))):
        assert pack_arrays(array) == pack_arrays(array.tolist())
        json.dumps(pack_arrays({"a": array, "b": [array, array]}))  # nothing left that JSON cannot write
    for preset in ("default", "paper"):
        state = initial_state(AlgorithmConfig.from_preset(preset), 1000, 5)
        state = dataclasses.replace(state, log_weights=rng.standard_normal(1000),
                                    changes=np.asarray(state.changes) if state.changes is not None else None)
        as_lists, as_arrays = pack_arrays(state.to_dict()), pack_arrays(state.to_dict(arrays=True))
        assert json.dumps(as_arrays) == json.dumps(as_lists)
        assert unpack_arrays(as_arrays) == state.to_dict()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_statistics_rows_read_into_numpy_are_the_rows_values(backend, tmp_path, request):
    """``_fetch_array`` (PostgreSQL: binary COPY) gives the values ``fetchall`` gives, bit for bit: float8
    columns, integer columns, a ``SUM`` of a bigint (``numeric`` on PostgreSQL), no rows at all."""
    import numpy as np

    import migrations
    from service.store import _copy_array, _fetch_array

    url = f"sqlite:///{tmp_path / 'rows.sqlite'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    migrations.upgrade(url)
    engine = make_engine(url)
    rng = np.random.default_rng(7)
    values = np.concatenate([rng.standard_normal(300) * 10.0 ** rng.integers(-300, 200, 300),
                             [0.0, -0.0, 5e-324, -1.5e200, 2.0 ** 53]])
    rows = [(1, 0, 0, index % 4, index, int(rng.integers(0, 2**40)), float(value), float(-value))
            for index, value in enumerate(values)]
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql("INSERT INTO experiments (id, name, config, status, seed, round_index, "
                                       "applied_rounds, pruned_rounds, state, version, created_at, updated_at) "
                                       "VALUES (1, 'e', '{}', 'running', 1, 0, 0, 0, '{}', 1, "
                                       "'2026-01-01 00:00:00', '2026-01-01 00:00:00')")
            connection.exec_driver_sql(
                "INSERT INTO round_statistics (experiment_id, round_index, segment_index, metric_index, arm_index, "
                f"count, sum, sum_of_squares) VALUES ({', '.join(['%s' if backend == 'postgres' else '?'] * 8)})",
                rows)
            plain = "SELECT metric_index, arm_index, count, sum, sum_of_squares FROM round_statistics " \
                    "WHERE experiment_id = {p} AND round_index = {p} ORDER BY arm_index"
            summed = "SELECT metric_index, 0, SUM(count), SUM(sum), 0.0 FROM round_statistics " \
                     "WHERE experiment_id = {p} GROUP BY metric_index ORDER BY metric_index"
            for sql, parameters in ((plain, (1, 0)), (summed, (1,)), (plain, (1, 9))):
                cursor = connection.connection.cursor()
                placeholder = "%s" if backend == "postgres" else "?"
                cursor.execute(sql.format(p=placeholder), parameters)
                expected = np.array(cursor.fetchall(), dtype=np.float64).reshape(-1, 5)
                cursor.close()
                data = _fetch_array(connection, sql, parameters, 5, np.float64)
                assert data.dtype == np.float64 and data.shape == expected.shape
                assert np.array_equal(data.view(np.int64), expected.view(np.int64))
                if backend == "postgres":  # the COPY path itself, not a fallback to the rows
                    assert _copy_array(connection, sql, parameters, 5, np.dtype(np.float64)) is not None
            counts = _fetch_array(connection, "SELECT round_index, arm_index, count, metric_index, arm_index "
                                              "FROM round_statistics WHERE experiment_id = {p}", (1,), 5, np.int64)
            assert counts.dtype == np.int64 and sorted(counts[:, 2].tolist()) == sorted(row[5] for row in rows)
    finally:
        engine.dispose()
