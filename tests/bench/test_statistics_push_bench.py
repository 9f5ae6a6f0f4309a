"""bench/statistics_push.py: a short run applies every batch once on both sides and rewrites only its own
section of benchmarks.md. No timing is asserted (the machine is shared)."""

from __future__ import annotations

import math

import pytest

from tests.bench.conftest import bench_script

OTHER_SECTIONS = "# Benchmarks\n\n## Scale\n\nscale figures\n\n## Statistics push\n\nold figures\n\n## Serving\n\nS\n"


@pytest.mark.timeout(300)
def test_short_run_measures_both_sides_and_writes_its_section(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(OTHER_SECTIONS)
    with bench_script("statistics_push") as module:
        results = module.main(["--repeats", "2", "--write-docs"], docs=docs)  # checks the stored counts itself
    (sqlite,) = results.values()
    assert sqlite["cells"] == 5_000
    for key in ("pasto", "raw", "ratio"):
        assert math.isfinite(sqlite[key]) and sqlite[key] > 0
    text = docs.read_text()
    assert "old figures" not in text and "scale figures" in text and text.endswith("## Serving\n\nS\n")
    assert "| SQLite |" in text and "python bench/statistics_push.py --repeats 2 --write-docs" in text
