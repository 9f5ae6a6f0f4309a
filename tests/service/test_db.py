"""``service.db``: PostgreSQL array literals read back as exactly the values they were made from, and
``Database.insert_new`` reports exactly the new rows, on its optimistic path and its fallback."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.db import Database, _array_literal, make_engine
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
        inserted = database.insert_new(
            session.connection(), ObservationId.__table__, COLUMNS,
            [(1, client_id, 0, 0) for client_id in sorted(client_ids)], returning=("client_id",),
            expect_new=expect_new)
    return [client_id for (client_id,) in inserted]


@pytest.mark.parametrize("expect_new", [True, False])
def test_insert_new_returns_exactly_the_new_rows(database, expect_new):
    assert insert_ids(database, ["a", "b"], expect_new) == ["a", "b"]
    # "b" exists: the plain insert fails as a whole and the checked insert decides.
    assert insert_ids(database, ["b", "c", "d"], expect_new) == ["c", "d"]
    assert insert_ids(database, ["a", "d"], expect_new) == []
    assert stored_ids(database) == ["a", "b", "c", "d"]


def test_insert_new_fallback_keeps_the_rest_of_the_transaction(database):
    with database.write() as session:
        connection = session.connection()
        table = ObservationId.__table__
        assert database.insert_new(connection, table, COLUMNS, [(1, "x", 0, 0)], ("client_id",), True) == [("x",)]
        assert database.insert_new(connection, table, COLUMNS, [(1, "x", 0, 0), (1, "y", 0, 0)], ("client_id",),
                                   True) == [("y",)]
    assert stored_ids(database) == ["x", "y"]


@pytest.mark.postgres
def test_insert_new_waits_for_a_concurrent_writer_of_the_same_id(postgres_url):
    """A writer whose plain insert meets an uncommitted row with the same key waits for it; once that
    commits, the fallback reports only the other rows as new (nothing is counted twice)."""
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
        second = threading.Thread(target=lambda: outcome.append(insert_ids(database, ["other", "shared"], True)))
        second.start()
        time.sleep(0.5)
        assert second.is_alive()  # blocked on the uncommitted "shared"
        first_transaction.commit()
        first.close()
        second.join(timeout=30)
        assert outcome == [["other"]]
        assert stored_ids(database) == ["other", "shared"]
    finally:
        engine.dispose()
