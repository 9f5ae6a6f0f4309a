"""``service.db``'s PostgreSQL array literals read back as exactly the values they were made from."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.db import _array_literal

pytestmark = pytest.mark.postgres

texts = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
special = st.sampled_from(['"', "\\", '\\"', "{", "}", ",", " ", "NULL", "null", "", "a b", "é🙂", "%s", "'", "\t\n"])
columns = st.one_of(
    st.lists(texts | special, min_size=1, max_size=20).map(lambda values: ("text", values)),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=20).map(lambda values: ("bigint", values)),
    st.lists(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**53, 2**53), min_size=1,
             max_size=20).map(lambda values: ("double precision", values)),
)


@pytest.fixture(scope="module")
def connection(postgres_server_url):
    engine = sa.create_engine(postgres_server_url)
    with engine.connect() as connection:
        yield connection.connection.driver_connection
    engine.dispose()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(columns)
def test_array_literals_read_back_exactly(connection, column):
    sql_type, values = column
    (read,) = connection.execute(f"SELECT %s::{sql_type}[]", (_array_literal(tuple(values)),)).fetchone()
    assert read == [float(value) for value in values] if sql_type == "double precision" else read == values
