"""bench/ofrep.py: a quick run measures every row against a real server, and --write-docs rewrites only
its own section of benchmarks.md."""

from __future__ import annotations

import pytest

from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("ofrep") as module:
        yield module


def test_a_quick_run_measures_every_row(bench, tmp_path):
    server = bench.Server(tmp_path)
    try:
        names = bench.create_experiments(server, 3, 4)
        http = bench.measure_http(server, names, requests=30, passes=1)
        local = bench.measure_provider(server, names[0], evaluations=500, passes=1)
    finally:
        server.stop()
    assert set(http) == {"single", "bulk"} and set(local) == {"provider", "sdk"}
    assert all(rate > 0 for pair in (*http.values(), *local.values()) for rate in pair)
    text = bench.table(http, local, 3, 4)
    assert text.count("\n| ") == 4 and "OFREP bulk, 3 flags" in text  # the four rows under the header


def test_write_section_replaces_only_its_section(bench, tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Client\n\nA\n\n## OpenFeature\n\nold\n\n## Serving\n\nB\n")
    bench.write_section("## OpenFeature\n\nnew\n", path)
    assert path.read_text() == "# Benchmarks\n\n## Client\n\nA\n\n## OpenFeature\n\nnew\n\n## Serving\n\nB\n"
    appended = tmp_path / "other.md"
    appended.write_text("# Benchmarks\n\n## Client\n\nA\n")
    bench.write_section("## OpenFeature\n\nnew\n", appended)
    assert appended.read_text() == "# Benchmarks\n\n## Client\n\nA\n\n## OpenFeature\n\nnew\n"
