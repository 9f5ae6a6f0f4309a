"""bench/scale.py: a quick run (10^5 events, DuckDB) measures both sides, agrees on the counts, and
rewrites only its own section of benchmarks.md. No timing is asserted (the machine is shared)."""

from __future__ import annotations

import math

import pytest

from tests.bench.conftest import bench_script

OTHER_SECTIONS = "# Benchmarks\n\n## Client\n\nclient figures\n\n## Scale\n\nold scale figures\n\n## Serving\n\nS\n"


@pytest.mark.timeout(300)
def test_quick_run_measures_both_sides_and_writes_its_section(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(OTHER_SECTIONS)
    with bench_script("scale") as module:
        output = module.main(["--quick", "--write-docs", "--data-dir", str(tmp_path / "data")], docs=docs)
    (row,) = output["rows"]
    assert row["engine"] == "duckdb" and row["events"] == 100_000
    assert row["same_result"], "pasto's step and the bare query attributed different event counts"
    assert 0 < row["attributed"] < row["events"], "the attribution rule drops events before exposure/after the window"
    for key in ("pasto_seconds", "bare_seconds", "ratio"):
        assert math.isfinite(row[key]) and row[key] > 0
    text = docs.read_text()
    assert "old scale figures" not in text and "client figures" in text and text.endswith("## Serving\n\nS\n")
    assert "| duckdb | 1e5 |" in text and "pasto >= 0.8 of the bare query's rate" in text
