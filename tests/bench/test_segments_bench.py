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


def _table(text: str) -> str:
    """The section from its first table heading on (the line above carries the date and timings)."""
    return text[text.index("### segments-global-guardrail"):]


def test_a_rerun_with_a_cache_computes_only_the_missing_chunks(bench, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    arguments = ["--runs-1", "12", "--runs-ablation", "2", "--runs-2", "2", "--rounds", "12", "--workers", "1",
                 "--print-only", "--cache-dir", str(cache)]
    assert bench.main(arguments) == 0
    first = capsys.readouterr().out
    files = sorted(cache.glob("*.pickle"))
    # Scenario 1's 12 runs are two chunks (10 + 2); every other row is one chunk.
    assert len(files) == 6
    assert "(cached)" not in first
    assert not list(cache.glob("*.tmp"))

    assert bench.main(arguments) == 0
    second = capsys.readouterr().out
    assert second.count("(cached)") == 6
    assert _table(second) == _table(first)

    lost = next(path for path in files if "seed1__runs2" in path.name)
    lost.unlink()
    assert bench.main(arguments + ["--status"]) == 0
    status = capsys.readouterr().out
    assert status.startswith("5 of 6 chunks cached") and "segments-global-guardrail / joint LP, z = 2 (default) seed 1" in status
    assert bench.main(arguments) == 0
    third = capsys.readouterr().out
    assert third.count("(cached)") == 5
    assert "segments-global-guardrail / joint LP, z = 2 (default) seed 1: " in third
    assert lost.is_file()
    assert _table(third) == _table(first)

    # A row whose configuration overrides change (same label) misses: its chunk ran another configuration.
    label, overrides = bench.ROWS_ONE[1]
    monkeypatch.setattr(bench, "ROWS_ONE", (bench.ROWS_ONE[0], (label, {**overrides, "confidence_z": 0.5})))
    assert bench.main(arguments + ["--status"]) == 0
    status = capsys.readouterr().out
    assert status.startswith("5 of 6 chunks cached") and f"segments-global-guardrail / {label} seed 0" in status
    monkeypatch.undo()

    # Results of other code (another fingerprint of pasto/, this bench and the scenario file) do not count.
    assert bench.code_fingerprint("segments-zipf") != bench.code_fingerprint("segments-global-guardrail")
    monkeypatch.setattr(bench, "code_fingerprint", lambda scenario: "0" * 16)
    assert bench.main(arguments + ["--status"]) == 0
    assert capsys.readouterr().out.startswith("0 of 6 chunks cached")
