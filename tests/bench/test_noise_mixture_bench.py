"""bench/noise_mixture.py: a tiny pass reports every rule with support figures, and resumes from its cache."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("noise_mixture") as module:
        yield module


def test_a_tiny_pass_reports_every_rule_and_resumes_from_its_cache(bench, tmp_path, monkeypatch, capsys):
    arguments = ["--runs", "3", "--rounds", "25", "--sigmas", "1.0", "--cache", str(tmp_path),
                 "--rules", "conservative-0,default,thompson"]
    bench.main(arguments)
    first = capsys.readouterr().out
    rows = [line for line in first.splitlines() if line.startswith("| 1.0 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["conservative-0", "default", "thompson"]
    for path in sorted(tmp_path.glob("setup-b_sigma1.0_*_runs3_rounds25_seed0.npz")):
        record = np.load(path)
        # 25 rounds of 10 observations: each run's support share is a share, and its least-observed
        # support arm cannot have more than all of them.
        assert np.all((record["support_share"] >= 0) & (record["support_share"] <= 1 + 1e-12)), path
        assert np.all((record["support_fewest"] >= 0) & (record["support_fewest"] <= 250 + 1e-9)), path
    assert len(list(tmp_path.glob("*.npz"))) == 3

    def no_simulation(*_, **__):
        raise AssertionError("a cached job was simulated again")

    monkeypatch.setattr(bench, "simulate", no_simulation)
    bench.main(arguments)
    second = capsys.readouterr().out
    assert [line for line in second.splitlines() if line.startswith("|")] == [
        line for line in first.splitlines() if line.startswith("|")]


def test_a_cached_job_is_not_reused_once_the_configuration_it_ran_with_changes(bench, tmp_path, monkeypatch, capsys):
    arguments = ["--runs", "2", "--rounds", "10", "--sigmas", "1.0", "--cache", str(tmp_path), "--rules", "default"]
    bench.main(arguments)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    simulated = []
    original = bench.simulate
    monkeypatch.setattr(bench, "simulate", lambda *a, **k: simulated.append(1) or original(*a, **k))
    # The default's options change (as when serving_posterior_draws went from 0 to 4): "default"
    # must run again, under a new key, not return the old default's figures.
    monkeypatch.setitem(bench.RULE_OPTIONS, "default", {"serving_posterior_draws": 0})
    bench.main(arguments)
    assert simulated == [1]
    assert len(list(tmp_path.glob("*.npz"))) == 2

