"""bench/segment_keys.py: a tiny pass measures every statement group on both layouts (which must hold the
same totals, or it stops) and rewrites only its own section of benchmarks.md. No timing is asserted."""

from __future__ import annotations

import math

import pytest

from tests.bench.conftest import bench_script

LABELS = ("unsegmented ingest", "unsegmented fold", "unsegmented read", "segmented ingest", "segmented fold",
          "segmented read", "segmented history")


@pytest.mark.parametrize("postgres", [False, pytest.param(True, marks=pytest.mark.postgres)])
def test_a_tiny_pass_reports_every_statement_group(tmp_path, monkeypatch, postgres, request):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Statistics keyed by segment\n\nold figures\n\n## Serving\n\nS\n")
    argv = ["--arms", "6", "--segments", "3", "--rounds", "3", "--write-docs"]
    if postgres:
        monkeypatch.setenv("PASTO_BENCH_POSTGRES_URL", request.getfixturevalue("postgres_server_url"))
        argv.append("--postgres")
    with bench_script("segment_keys") as module:
        results = module.main(argv, docs=docs)
    assert list(results) == (["SQLite", "PostgreSQL"] if postgres else ["SQLite"])
    for report in results.values():
        assert tuple(report) == LABELS
        assert all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in report.values())
    text = docs.read_text()
    assert "old figures" not in text and text.endswith("## Serving\n\nS\n")
    for backend in results:
        for label in LABELS:
            assert f"| {backend} | {label} |" in text


def test_layouts_that_disagree_stop_the_run(tmp_path, monkeypatch):
    with bench_script("segment_keys") as module:
        real = module.upsert

        def lossy(table, keys, rows):  # 0017's segmented cells lose their last row
            return real(table, keys, rows[:-1] if table == "round_17" and rows and rows[0][0] == module.SEGMENTED
                        else rows)

        monkeypatch.setattr(module, "upsert", lossy)
        with pytest.raises(SystemExit, match="totals over segments differ"):
            module.main(["--arms", "6", "--segments", "3", "--rounds", "2"], docs=tmp_path / "unused.md")
