"""bench/client.py: it measures every row, and rewrites only its own section of benchmarks.md."""

from __future__ import annotations

import pytest

from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("client") as module:
        yield module


def test_measure_reports_every_row(bench):
    pytest.importorskip("growthbook")
    units = [f"user-{i}" for i in range(300)]
    results = bench.measure(units, n_arms=5, batch_size=100, repeats=1)
    assert set(results) == {
        "hash only (PrefixHasher)",
        "pasto LocalAssigner.assign",
        "pasto LocalAssigner.assign_many (batches of 100)",
        # assign_many's baselines: a plain numpy batch hash, and pasto's own batch hash alone
        "numpy batch hash (bare baseline of assign_many)",
        "pasto.hashing.buckets (assign_many's hash alone)",
        "growthbook hash+choose (gbhash v1 + chooseVariation)",
        "growthbook GrowthBook.run()",
        # the exposure log's overhead: wall-clock and CPU time, with and without a sink
        "pasto LocalAssigner.assign [cpu]",
        "pasto LocalAssigner.assign + JSON-lines sink",
        "pasto LocalAssigner.assign + JSON-lines sink [cpu]",
        "pasto LocalAssigner.assign + Parquet sink",
        "pasto LocalAssigner.assign + Parquet sink [cpu]",
    }
    assert all(value > 0 for value in results.values())


def test_memory_per_arm_is_measured_against_the_bare_minimum(bench):
    figures = bench.measure_memory(1000)
    assert figures["bare"] > 0 and figures["held"] >= figures["bare"]
    assert figures["after"] >= figures["held"] and 0 < figures["drawn"] <= 1000


def test_write_section_replaces_only_the_client_section(bench, tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Convergence\n\nfigures A\n\n## Client\n\nold\n\n## Serving\n\nfigures B\n")
    bench.write_section("## Client\n\nnew table\n", path)
    assert path.read_text() == (
        "# Benchmarks\n\n## Convergence\n\nfigures A\n\n## Client\n\nnew table\n\n## Serving\n\nfigures B\n"
    )
    bench.write_section("## Client\n\nnewer\n", path)
    assert "newer" in path.read_text() and "new table" not in path.read_text()


def test_write_section_appends_when_missing(bench, tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Convergence\n\nfigures A\n")
    bench.write_section("## Client\n\ntable\n", path)
    assert path.read_text() == "# Benchmarks\n\n## Convergence\n\nfigures A\n\n## Client\n\ntable\n"
