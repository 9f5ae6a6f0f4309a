"""bench/update_draws.py: a tiny pass prints one row per K with both settings and their ratio."""

from __future__ import annotations

import math

import pytest

from tests.bench.conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("update_draws") as module:
        yield module


def test_a_tiny_pass_times_both_settings_per_k(bench, capsys, monkeypatch):
    calls = []
    original = bench.measure_update_alone

    def recorded(n_arms, preset, rounds, seed=0, overrides=None):
        calls.append((n_arms, overrides["serving_posterior_draws"]))
        return original(n_arms, preset, rounds, seed=seed, overrides=overrides)

    monkeypatch.setattr(bench, "measure_update_alone", recorded)
    results = bench.main(["--arms", "5,20", "--rounds", "2", "--repeats", "2"])
    # Alternating order: 0 then 4, then 4 then 0, for each K.
    assert calls == [(5, 0), (5, 4), (5, 4), (5, 0), (20, 0), (20, 4), (20, 4), (20, 0)]
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "K |" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["5", "20"]
    for n_arms in (5, 20):
        figures = results[n_arms]
        assert figures["0"] > 0 and figures["4"] > 0 and math.isfinite(figures["ratio"])


def test_another_option_can_be_compared(bench, capsys, monkeypatch):
    calls = []
    original = bench.measure_update_alone

    def recorded(n_arms, preset, rounds, seed=0, overrides=None):
        calls.append((n_arms, overrides))
        return original(n_arms, preset, rounds, seed=seed, overrides=overrides)

    monkeypatch.setattr(bench, "measure_update_alone", recorded)
    results = bench.main(["--arms", "5", "--rounds", "2", "--repeats", "2",
                          "--option", "serving_level", "--values", "0.9,0.95"])
    assert calls == [(5, {"serving_level": 0.9}), (5, {"serving_level": 0.95}),
                     (5, {"serving_level": 0.95}), (5, {"serving_level": 0.9})]
    assert results[5]["0.9"] > 0 and results[5]["0.95"] > 0 and math.isfinite(results[5]["ratio"])
    assert "serving_level = 0.9" in capsys.readouterr().out


def test_against_bare_times_the_update_beside_a_thompson_step_and_one_solve(bench, capsys):
    results = bench.main(["--against-bare", "--arms", "5,40", "--rounds", "2", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "K |" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["5", "40"]
    for n_arms in (5, 40):
        figures = results[n_arms]
        assert all(figures[name] > 0 for name in ("update", "thompson_1", "thompson_16", "solve"))
        assert figures["ratio"] > 0 and math.isfinite(figures["ratio"])
