"""bench/sqlite_decay.py: every observation it sends is stored once, and every slice is measured."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("sqlite_decay") as module:
        yield module


@pytest.mark.parametrize("options", [{}, {"rowid": False}], ids=["service schema", "without rowid"])
def test_run_stores_every_observation_and_measures_every_slice(bench, tmp_path, options):
    result = bench.run(observations=2_000, batch=100, n_arms=3, pragmas=["cache_size=-4096"],
                       folder=tmp_path, **options)
    assert result["observations"] == result["accepted"] == 2_000
    assert len(result["rates"]) == len(result["cpu_us"]) == len(result["written_kb"]) == bench.SLICES
    assert all(rate > 0 for rate in result["rates"])
    assert result["ratio"] == pytest.approx(result["rates"][-1] / result["rates"][0])
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'decay.sqlite'}")
    with engine.connect() as connection:
        stored = connection.exec_driver_sql("SELECT count(*) FROM observation_ids").scalar()
        rowid_free = connection.exec_driver_sql(
            "SELECT sql LIKE '%WITHOUT ROWID%' FROM sqlite_master WHERE name = 'observation_ids'").scalar()
    engine.dispose()
    assert stored == 2_000
    assert bool(rowid_free) == (options.get("rowid") is False)


def test_prune_every_closes_rounds_and_prunes_their_ids(bench, tmp_path):
    """--prune-every: every 500 observations the round is closed and the applied rounds' ids pruned; the
    statistics keep every observation once."""
    result = bench.run(observations=2_000, batch=100, n_arms=3, pragmas=[], folder=tmp_path, prune_every=500)
    assert result["observations"] == result["accepted"] == 2_000
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'decay.sqlite'}")
    with engine.connect() as connection:
        ids = connection.exec_driver_sql("SELECT count(*) FROM observation_ids").scalar()
        pruned = connection.exec_driver_sql("SELECT pruned_rounds FROM experiments").scalar()
        per_round = connection.exec_driver_sql(
            "SELECT round_index, sum(observations) FROM arm_round_counts GROUP BY round_index ORDER BY 1").all()
    engine.dispose()
    assert ids == 0 and pruned == 4
    assert per_round == [(0, 500), (1, 500), (2, 500), (3, 500)]
