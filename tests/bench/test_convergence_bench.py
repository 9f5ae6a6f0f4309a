"""bench/convergence.py: a tiny pass reports every row, and only its own section of benchmarks.md changes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("convergence") as module:
        yield module


def test_write_section_replaces_only_the_convergence_section(bench, tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Client\n\nfigures A\n\n## Convergence\n\nold\n\n## Serving\n\nfigures B\n")
    bench.write_section("## Convergence\n\nnew table\n", path)
    assert path.read_text() == (
        "# Benchmarks\n\n## Client\n\nfigures A\n\n## Convergence\n\nnew table\n\n## Serving\n\nfigures B\n"
    )
    path.write_text("# Benchmarks\n\n## Client\n\nfigures A\n")
    bench.write_section("## Convergence\n\nnew table\n", path)
    assert path.read_text() == "# Benchmarks\n\n## Client\n\nfigures A\n\n## Convergence\n\nnew table\n"


def test_a_tiny_pass_reports_every_row_and_the_paper_reference(bench, tmp_path, monkeypatch, capsys):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Serving\n\nkeep me\n")
    monkeypatch.setattr(bench, "DOCS", docs)
    monkeypatch.setattr(bench, "SIGMAS", (0.1,))
    # The ablations (seven runs of the default preset) on setup B's 20 rounds, not setup A's 100:
    # every row is rendered the same way, for a fifth of the updates.
    monkeypatch.setattr(bench, "ABLATION_SETUPS", ("B sigma=0.1",))
    json_path = tmp_path / "results.json"
    code = bench.main([
        "--runs", "3", "--rounds-a", "100", "--rounds-b", "20", "--workers", "1", "--paper-seeds", "2",
        "--skip-throughput", "--json", str(json_path),
    ])
    assert code == 0
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\n## Serving\n\nkeep me\n\n## Convergence\n")
    rows = [f"| {name} |" for name in bench.MAIN_ALGORITHMS + ("exploration",)]
    rows += [f"| {name} |" for name, _ in bench.ABLATIONS]
    rows += [f"| exploration deploy={rule} |" for rule in bench.DEPLOY_ABLATIONS]
    section = text.split("## Convergence", 1)[1]
    setup_a = section.split("### Setup A", 1)[1].split("### Setup B", 1)[0]
    setup_b = section.split("### Setup B", 1)[1].split("### ", 1)[0]
    for row in rows:
        assert row in setup_b, row
    for name in bench.MAIN_ALGORITHMS:
        assert f"| {name} |" in setup_a, name
    assert "| default estimator=ips |" not in setup_a
    assert "| paper, A, mean f at 100 = 0.59 +- 0.02 (ALGORITHM.md) |" in section
    assert "| 100 | 0.59 |" in section  # the paper-against-reference table, with the extra seeds
    assert "2 more seeds" in section


def test_the_serving_subsection_is_replaced_alone_and_kept_by_full_runs(bench, tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\n## Convergence\n\nold table\n\n## Serving\n\nfigures B\n")
    bench.write_serving_subsection("### Safe serving\n\nrows 1\n", path)
    assert path.read_text() == (
        "# Benchmarks\n\n## Convergence\n\n### Safe serving\n\nrows 1\n\nold table\n\n## Serving\n\nfigures B\n"
    )
    bench.write_serving_subsection("### Safe serving\n\nrows 2\n", path)
    assert "rows 2" in path.read_text() and "rows 1" not in path.read_text()
    bench.write_section("## Convergence\n\nnew table\n", path)
    assert path.read_text() == (
        "# Benchmarks\n\n## Convergence\n\n### Safe serving\n\nrows 2\n\nnew table\n\n## Serving\n\nfigures B\n"
    )


def test_a_tiny_serving_pass_reports_served_and_deployed_figures_and_the_targets(bench, monkeypatch, tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Convergence\n\nold table\n")
    monkeypatch.setattr(bench, "DOCS", docs)
    monkeypatch.setattr(bench, "SERVING_ROWS", (
        ("demo", "demo", None, 25, ("default", "thompson")),
        ("A drift", "setup-a-drift", None, 70, ("default",)),
    ))
    load_scenario = bench.load_scenario

    def early_drift(name):
        # The shipped drift comes at round 1000; the row's reading only needs a change and a
        # checkpoint within 300 rounds of it, so the tiny pass moves it to round 40.
        scenario = load_scenario(name)
        if name != "setup-a-drift":
            return scenario
        document = scenario.to_dict()
        document["drift"]["at_round"] = 40
        document["checkpoints"] = [40, 70]
        return bench.scenario_from_dict(document)

    monkeypatch.setattr(bench, "load_scenario", early_drift)
    assert bench.main(["--serving", "--runs", "2", "--workers", "1"]) == 0
    text = docs.read_text()
    assert "### Safe serving" in text and "old table" in text
    assert "| demo | default | 25 |" in text and "| demo | thompson | 25 |" in text
    assert "| demo: served holds every hard guardrail in >= 97% of (run, round) pairs after round 20 |" not in text
    assert "| drift: deployed mean r >= 0.9 within 300 rounds of the change (round 70) |" in text
    assert "| drift: no run ends on a guardrail-breaking single arm |" in text


def test_noise_rows_run_in_blocks_of_their_own_seeds_and_are_pooled(bench, monkeypatch):
    # The sigma 1.0 row in two blocks of 2 runs (seeds 0 and 1) is the two separate runs side by side.
    monkeypatch.setattr(bench, "NOISE_BLOCK_RUNS", 2)
    rows = (("B sigma=1.0", "setup-b", 1.0, 6, ("default", "thompson")),
            ("B sigma=0.1", "setup-b", 0.1, 6, ("default",)))
    results = bench.run_serving(runs=3, seed=0, workers=1, rows=rows, noise_runs=4)
    noise, other = results["B sigma=1.0"], results["B sigma=0.1"]
    assert (noise["runs"], noise["seeds"], other["runs"], other["seeds"]) == (4, [0, 1], 3, [0])
    summary, f, r, _ = noise["default"]
    assert f.shape == r.shape == (len(noise["scenario"].checkpoints), 4) and summary["runs"] == 4
    for block, seed in enumerate((0, 1)):
        scenario = bench.load_scenario("setup-b").with_overrides(runs=2, rounds=6, seed=seed, noise_std=1.0)
        alone = bench.simulate(scenario, bench.make_policy("default"))
        assert (f[:, 2 * block:2 * block + 2] == alone.deployed_values[[c - 1 for c in scenario.checkpoints]]).all()
        regret = alone.summary["checkpoints"][-1]["cumulative_regret"]["mean"]
        if block == 0:
            first = regret
    assert summary["checkpoints"][-1]["cumulative_regret"]["mean"] == pytest.approx((first + regret) / 2)
    text = bench.render_serving(results, "python bench/convergence.py --serving", 3, 1.0)
    assert "Rows B sigma=1.0: 4 runs each, in 2 blocks of 2 (seeds 0, 1;" in text
    with pytest.raises(SystemExit, match="does not split"):
        bench._blocks("B sigma=1.0", 3, 5, 0)


def test_pooled_blocks_weight_the_hard_guardrail_shares_by_their_runs(bench):
    def block(runs, share, seed):
        summary = {"runs": runs, "seed": seed, "runs_ending_on_a_breaking_arm": seed,
                   "hard_guardrails": {"tolerance": 0.001, "served_hold_share": share, "deployed_hold_share": share,
                                       "deployed_hold_share_at": {"10": share}},
                   "checkpoints": [{"round": 10, "cumulative_regret": {"mean": 10.0 * share, "standard_error": 1.0}}]}
        return summary, np.full((1, runs), share), np.full((1, runs), share), 1.0

    summary, f, r, seconds = bench._pool_blocks([block(1, 1.0, 1), block(3, 0.6, 2)])
    assert summary["runs"] == 4 and summary["seed"] == [1, 2] and summary["runs_ending_on_a_breaking_arm"] == 3
    assert summary["hard_guardrails"]["served_hold_share"] == pytest.approx(0.7)
    assert summary["hard_guardrails"]["deployed_hold_share_at"] == {"10": pytest.approx(0.7)}
    assert summary["checkpoints"][0]["cumulative_regret"]["mean"] == pytest.approx(7.0)
    assert summary["checkpoints"][0]["cumulative_regret"]["standard_error"] == pytest.approx(np.sqrt(10) / 4)
    assert f.shape == (1, 4) and seconds == 2.0
