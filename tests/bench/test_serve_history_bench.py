"""bench/serve.py history: a small run measures the full and the summarised poll in the same run and
rewrites only its own section of benchmarks.md.

No timing is asserted (the machine is shared); the bytes are exact, so the summarised poll's being
smaller is.
"""

from __future__ import annotations

import pytest

from tests.bench.conftest import bench_script

OTHER_SECTIONS = ("# Benchmarks\n\n## Serving\n\nserving figures\n\n"
                  "## Dashboard poll at K = 10,000 after 1,000 rounds\n\nold poll figures\n\n## Segments\n\nfigures S\n")


@pytest.mark.timeout(300)
def test_a_small_history_run_measures_both_polls_and_writes_its_section(tmp_path):
    # 400 arms: the summarised poll lists 100 of them. (With 150 it saved too few bytes to stay below
    # the full poll once exact solves served most arms exactly 0, whose JSON is short.)
    docs = tmp_path / "benchmarks.md"
    docs.write_text(OTHER_SECTIONS)
    with bench_script("serve") as module:
        results = module.main(["history", "--arms", "400", "--rounds", "4", "--units", "300", "--repeats", "2",
                               "--write-docs"], docs=docs)
    full, summarised = results["poll"], results["summary_poll"]
    # Rounds 0-3 applied, round 4 served: each poll reads the experiment, its diagnostics and one round.
    for poll in (full, summarised):
        assert poll["parts"]["rounds"][2:] == (1, 1) and poll["ms"] > 0
    assert summarised["bytes"] < full["bytes"]
    for part in ("experiment", "diagnostics", "rounds"):
        assert summarised["parts"][part][1] < full["parts"][part][1], part
    assert results["summary_first_load"]["parts"]["rounds"][3] == 5
    text = docs.read_text()
    assert "old poll figures" not in text
    assert "serving figures" in text and "figures S" in text
    section = text.split("## Dashboard poll at K = 10,000 after 1,000 rounds\n", 1)[1].split("\n## ", 1)[0]
    assert "`?arms=100`" in section and f"| {summarised['bytes']:,} |" in section and f"| {full['bytes']:,} |" in section
    assert "history --arms 400 --rounds 4 --units 300 --repeats 2" in section and "--write-docs" not in section


@pytest.mark.timeout(300)
def test_the_diagnostics_solve_run_reuses_the_optimum_when_idle_and_solves_after_ingestion(tmp_path):
    with bench_script("serve") as module:
        results = module.main(["diagnostics-solve", "--arms", "150", "--rounds", "2", "--units", "300",
                               "--repeats", "3", "--batch", "5"])
    # What is timed is what it says: every request after an ingestion solved, none of the idle ones did.
    assert results["solved"] == {"hit": 0, "solve": 3}
    assert len(results["hits"]) == len(results["solves"]) == 3
