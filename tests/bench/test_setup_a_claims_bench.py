"""bench/setup_a_claims.py: a tiny pass reports every row and claim, and only its own section changes."""

from __future__ import annotations

from tests.bench.conftest import bench_script


def test_a_tiny_pass_writes_its_rows_and_claims_and_leaves_the_other_sections(tmp_path, monkeypatch):
    with bench_script("setup_a_claims") as bench:
        docs = tmp_path / "benchmarks.md"
        docs.write_text("# Benchmarks\n\n## Convergence\n\nkeep me\n")
        monkeypatch.setattr(bench, "DOCS", docs)
        assert bench.main(["--runs", "2", "--rounds", "6", "--delay", "2", "--workers", "1", "--write-docs"]) == 0
        first = docs.read_text()
        assert first.startswith("# Benchmarks\n\n## Convergence\n\nkeep me\n\n" + bench.HEADING + "\n")
        section = first.split(bench.HEADING, 1)[1]
        assert "`python bench/setup_a_claims.py --runs 2 --rounds 6 --delay 2 --seed 0`" in section
        for row in ("default", "default, delay 2", "paper"):
            assert f"\n| {row} | " in section, row
        for claim in ("default: mean f >= 0.9", "default: mean f above paper's",
                      "default: mean cumulative regret below paper's",
                      "default, observations 2 rounds late: mean f >= 0.9",
                      "default: second half's regret < 0.6 x the first half's"):
            assert f"\n| {claim} | " in section, claim
        assert "2 runs, deployed mixture at round 6" in section
        # A second run replaces the section instead of adding one.
        assert bench.main(["--runs", "2", "--rounds", "6", "--delay", "2", "--workers", "1", "--write-docs"]) == 0
        assert docs.read_text().count(bench.HEADING) == 1
