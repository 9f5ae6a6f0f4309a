"""bench/serve.py: a quick run measures every row, and rewrites only its own section of benchmarks.md.

No timing is asserted (the machine is shared); only that every figure was measured, that nothing
failed, and that the assignment path wrote nothing to the database.
"""

from __future__ import annotations

import math

import pytest

from tests.bench.conftest import bench_script

OTHER_SECTIONS = "# Benchmarks\n\n## Client\n\nclient figures\n\n## Serving\n\nold serving figures\n\n## Convergence\n\nfigures C\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs") / "benchmarks.md"
    docs.write_text(OTHER_SECTIONS)
    with bench_script("serve") as module:
        return module.main(["--quick", "--write-docs"], docs=docs), docs


def _measured(row: dict) -> bool:
    return row["count"] > 0 and row["rate"] > 0 and math.isfinite(row["p50_ms"]) and math.isfinite(row["p99_ms"])


@pytest.mark.timeout(120)
def test_quick_run_measures_every_row(run):
    output, _ = run
    (backend, results), = output["results"].items()
    assert backend.startswith("SQLite")
    for kind in ("assign", "assign_batch"):
        for side in ("bare", "pasto"):
            assert _measured(results[kind][side]), (kind, side)
            assert results[kind][side]["errors"] == 0
    for side in ("raw INSERT", "bare", "pasto"):
        assert _measured(results["ingest"][side]), side
        assert results["ingest"][side]["errors"] == 0
    assert results["ingest"]["pasto"]["stored"] == results["ingest"]["pasto"]["sent"] > 0
    statements = dict(results["assign"]["statements"])
    assert statements.pop("requests") > 0
    # The assignment path writes nothing: reads only (the token and snapshot checks), each in a read
    # transaction that SQLAlchemy opens with BEGIN since the SQLite connection runs in autocommit mode
    # (service/db.py: write transactions need BEGIN IMMEDIATE) and ends with ROLLBACK.
    assert set(statements) <= {"SELECT", "BEGIN", "ROLLBACK"}, statements
    for preset in ("default", "paper"):
        close = results["close"][f"100/{preset}"]
        assert close["transaction"]["median_ms"] > 0 and close["total"]["median_ms"] > 0 and close["reload_ms"] > 0
        assert output["update_alone"][f"100/{preset}"]["median_ms"] > 0
    # Safe serving solves exactly in every round (no periodic re-solve): no round is a "solve round".
    assert output["update_alone"]["100/default"]["solve_ms"] is None
    section = output["section"]
    assert section.startswith("## Serving\n")
    for row in ("| assign, 1 unit |", "| assign, 100 units |", "| ingest, batches of 1,000 |", "| 100 | default |",
                "| 100 | paper |"):
        assert row in section


def test_only_the_serving_section_is_rewritten(run):
    output, docs = run
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n## Client\n\nclient figures\n\n## Serving\n")
    assert text.endswith("\n## Convergence\n\nfigures C\n")
    assert "old serving figures" not in text
    assert output["section"].rstrip("\n") in text


@pytest.mark.timeout(120)
def test_segmented_close_quick_run_measures_both_closes(tmp_path):
    """``--segmented-close --quick``: both closes measured on SQLite, only its own section rewritten."""
    docs = tmp_path / "benchmarks.md"
    docs.write_text(OTHER_SECTIONS)
    with bench_script("serve") as module:
        output = module.main(["--segmented-close", "--quick", "--write-docs"], docs=docs)
    (backend, result), = output["results"].items()
    assert backend == "SQLite"
    for kind in ("plain", "segmented"):
        for part in ("transaction", "total"):
            assert math.isfinite(result[kind][part]["median_ms"]) and result[kind][part]["median_ms"] > 0
    text = docs.read_text()
    assert text.startswith(OTHER_SECTIONS.rstrip("\n"))
    assert "## Segmented round close" in text and "| SQLite |" in text


@pytest.mark.timeout(300)
def test_close_subcommand_measures_the_close_its_bare_sql_and_the_poll():
    with bench_script("serve") as module:
        results = module.main(["close", "--backends", "sqlite", "--arms", "200", "--rounds", "2", "--parts"])
    (key, row), = results.items()
    assert key == "sqlite/200" and row["error"] is None
    assert len(row["close_ms"]) == 1 and row["close_ms"][0] > 0 and row["bare_ms"][0] > 0
    # --parts: every part of the close timed in the timed round, and the timing wrappers removed after
    import service.store

    assert set(row["parts_ms"][0]) == {label for _, _, label in module.CLOSE_PARTS}
    assert not hasattr(service.store._write_pooled_arrays, "__wrapped__")
    assert row["peak_mb"] > 0 and row["update_ms"] > 0
    assert row["poll_experiment"][0] == 200 and row["poll_rounds"][0] == 200


@pytest.mark.timeout(300)
def test_best_arm_subcommand_times_both_paths_and_restores_the_threshold():
    from pasto import serving

    threshold = serving._BEST_ARM_LEVELS_FROM
    with bench_script("serve") as module:
        results = module.main(["best-arm", "--arms", "1500", "--rounds", "2", "--repeats", "2"])
    assert list(results) == [1500] and len(results[1500]) == 2
    assert all(pair["every"] > 0 and pair["levels"] > 0 for pair in results[1500])
    assert serving._BEST_ARM_LEVELS_FROM == threshold


@pytest.mark.timeout(300)
def test_secure_delete_subcommand_times_both_settings():
    with bench_script("serve") as module:
        results = module.main(["secure-delete", "--arms", "2000", "--repeats", "2"])
    assert len(results["times"]["1"]) == len(results["times"]["FAST"]) == 2
    assert results["ratio"] > 0


@pytest.mark.timeout(300)
def test_assign_subcommand_measures_both_endpoints():
    with bench_script("serve") as module:
        results = module.main(["assign", "--backends", "sqlite", "--seconds", "0.3", "--repeats", "1",
                               "--requests", "50", "--clients", "1"])
    for kind in ("assign", "assign_batch"):
        for side in ("bare", "pasto"):
            assert _measured(results[f"sqlite/{kind}"][side]) and results[f"sqlite/{kind}"][side]["errors"] == 0


@pytest.mark.timeout(300)
def test_assign_subcommand_with_wrk_reports_server_cpu_per_request():
    """The ``--wrk`` load (Debian's wrk, installed by .ci/run) and the server's CPU per request."""
    with bench_script("serve") as module:
        results = module.main(["assign", "--backends", "sqlite", "--wrk", "--seconds", "1", "--repeats", "1",
                               "--connections", "2", "--batch-size", "20"])
    for kind in ("assign", "assign_batch"):
        for side in ("bare", "pasto"):
            row = results[f"sqlite/{kind}"][side]
            assert row["count"] > 0 and row["errors"] == 0 and row["cpu_min"] > 0, (kind, side, row)
