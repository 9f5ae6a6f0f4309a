"""bench/segments.py: a tiny pass reports every row, and only its own section of benchmarks.md changes."""

from __future__ import annotations

import pytest

from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("segments") as module:
        yield module


def test_write_section_replaces_only_the_segments_section(bench, tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Segments\n\nold\n\n## Serving\n\nfigures B\n")
    bench.write_section("## Segments\n\nnew table\n", path)
    assert path.read_text() == "# Benchmarks\n\n## Segments\n\nnew table\n\n## Serving\n\nfigures B\n"


def test_a_tiny_pass_reports_every_row(bench, tmp_path, monkeypatch):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Serving\n\nkeep me\n")
    monkeypatch.setattr(bench, "DOCS", docs)
    code = bench.main(["--runs-1", "2", "--runs-ablation", "2", "--runs-2", "2", "--rounds", "12", "--workers", "1"])
    assert code == 0
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n## Serving\n\nkeep me\n\n## Segments\n")
    for label, _ in bench.ROWS_ONE + bench.ROWS_TWO:
        assert f"| {label} | 12 | 2 |" in text, label
    assert "with the global guardrail 0.6400" in text
    assert "28 of 50" in text
