import pytest
import sqlalchemy as sa


@pytest.mark.postgres
def test_postgres_fixture_gives_a_fresh_writable_database(postgres_url):
    engine = sa.create_engine(postgres_url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE probe (value integer)"))
        connection.execute(sa.text("INSERT INTO probe VALUES (41), (1)"))
        total = connection.execute(sa.text("SELECT sum(value) FROM probe")).scalar_one()
        server_version = connection.execute(sa.text("SHOW server_version")).scalar_one()
    engine.dispose()
    assert total == 42
    assert server_version
