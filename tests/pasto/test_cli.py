"""`pasto simulate` end to end (the service's commands, discovered through entry points, are tested in
tests/service/test_cli.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pasto.cli import _Progress, main, parse_setting


def test_simulate_prints_the_table_and_writes_the_json(tmp_path, capsys):
    out = tmp_path / "result.json"
    status = main(["simulate", "setup-a", "--algorithm", "paper", "--runs", "30", "--rounds", "200",
                   "--seed", "7", "--out", str(out)])
    captured = capsys.readouterr()
    assert status == 0
    assert "scenario setup-a  algorithm paper  runs 30  rounds 200  seed 7" in captured.out
    assert "best single arm f = 0.0000   best mixture f = 1.0125" in captured.out
    lines = [line for line in captured.out.splitlines() if line.strip().startswith(("100 |", "200 |"))]
    assert len(lines) == 2
    document = json.loads(out.read_text())
    assert document["scenario"] == "setup-a" and document["algorithm"] == "paper"
    assert document["runs"] == 30 and document["rounds"] == 200 and document["seed"] == 7
    assert [row["round"] for row in document["checkpoints"]] == [100, 200]
    assert document["best_single"] == pytest.approx(0.0) and document["best_mixture"] == pytest.approx(1.0125, abs=1e-4)
    assert document["config"]["estimator"] == "ips"
    row = document["checkpoints"][-1]
    assert f"{row['objective']['mean']:9.3f}" in lines[-1]


def test_same_seed_identical_json(tmp_path, capsys):
    paths = [tmp_path / "first.json", tmp_path / "second.json"]
    for path in paths:  # four runs: a batch of more than one (the simulator's run dimension)
        assert main(["simulate", "setup-a", "--runs", "4", "--rounds", "60", "--out", str(path)]) == 0
    capsys.readouterr()
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_settings_and_noise_override_reach_the_simulation(tmp_path, capsys):
    out = tmp_path / "ablation.json"
    argv = ["simulate", "setup-a", "--runs", "10", "--rounds", "50", "--noise-std", "0.5",
            "--set", "serving=exploration", "--set", "deploy=average", "--set", "solve_every=10",
            "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    document = json.loads(out.read_text())
    assert document["config"]["deploy"] == "average" and document["config"]["solve_every"] == 10
    # An option of the rule not chosen (safe serving has no deploy rule) is an error, not a no-op.
    assert main(argv[:8] + argv[10:]) == 2
    assert "belong to serving 'exploration'" in capsys.readouterr().err
    assert document["noise"]["std"] == [0.5, 0.5]


def test_baselines_run_from_the_cli(capsys):
    for algorithm in ("scgd", "thompson"):
        assert main(["simulate", "setup-a", "--algorithm", algorithm, "--runs", "5", "--rounds", "30"]) == 0
        assert f"algorithm {algorithm}" in capsys.readouterr().out


def test_a_scenario_path_works(tmp_path, capsys):
    path = tmp_path / "two-arms.json"
    path.write_text(json.dumps({
        "name": "two-arms", "metrics": ["x"], "objective": {"primary": "x"},
        "arms": {"means": [[0.0, 1.0]]}, "noise": {"kind": "gaussian", "std": 0.1}, "rounds": 20,
    }))
    assert main(["simulate", str(path), "--runs", "4"]) == 0
    assert "scenario two-arms" in capsys.readouterr().out


def test_parse_setting_reads_json_values():
    assert parse_setting("step_size=0.5") == ("step_size", 0.5)
    assert parse_setting("horizon=null") == ("horizon", None)
    assert parse_setting("deploy=average") == ("deploy", "average")
    assert parse_setting(" estimator = pooled") == ("estimator", " pooled")


def test_progress_line_uses_carriage_returns():
    stream = io.StringIO()
    progress = _Progress(stream, "setup-b/paper")
    progress("optimum", 1, 2)
    progress("optimum", 2, 2)
    progress("rounds", 1, 4)
    progress("rounds", 4, 4)
    text = stream.getvalue()
    assert text.startswith("\rsetup-b/paper [")
    assert "2/2 runs' optima solved" in text
    assert "\rsetup-b/paper [" + "#" * 30 + "] 4/4 rounds" in text and text.endswith("\n")


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    status = main(["simulate", "setup-a", "--runs", "3", "--rounds", "20", "--plot", str(tmp_path / "c.png")])
    assert status == 2
    err = capsys.readouterr().err
    # pasto is not on PyPI: the hint names this project's extra, installed from the checkout.
    assert "pip install -e '.[plot]'" in err and "pip install pasto" not in err
    assert not (tmp_path / "c.png").exists()


def test_plot_writes_an_image(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "curve.png"
    assert main(["simulate", "setup-a", "--runs", "5", "--rounds", "40", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_entry_point_in_a_subprocess_never_imports_the_web_stack(tmp_path):
    out = tmp_path / "result.json"
    code = (
        "import sys; from pasto.cli import main; "
        f"status = main(['simulate', 'setup-a', '--runs', '4', '--rounds', '30', '--out', {str(out)!r}]); "
        "assert 'flask' not in sys.modules and 'sqlalchemy' not in sys.modules, 'web stack imported'; "
        "sys.exit(status)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "scenario setup-a" in completed.stdout
    assert json.loads(out.read_text())["runs"] == 4
    module = subprocess.run(
        [sys.executable, "-m", "pasto.cli", "simulate", "setup-b", "--runs", "2", "--rounds", "5", "--quiet"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert module.returncode == 0, module.stderr
    # Drawn means: the reference line is the mean over the runs (fixed means print their own).
    assert "scenario setup-b" in module.stdout
    assert module.stdout.splitlines()[1].startswith("best single arm f = ")
    assert "best mixture f = " in module.stdout and "means over the runs' drawn true means" in module.stdout
    assert module.stderr == ""  # --quiet: no progress report


def test_simulate_help_shows_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert "example:\n  pasto simulate setup-a --algorithm paper --runs 1000 --plot curve.png" in out


def test_the_plot_says_what_is_drawn_and_why_early_rounds_dip(tmp_path, capsys):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in the SVG, so it can be read back
    try:
        path = tmp_path / "curve.svg"
        # setup-a under the paper preset starts at the near-optimal uniform mixture and dips.
        assert main(["simulate", "setup-a", "--algorithm", "paper", "--runs", "40", "--rounds", "120",
                     "--plot", str(path), "--quiet"]) == 0
    finally:
        matplotlib.rcParams["svg.fonttype"] = "path"
    svg = path.read_text()
    assert "Drawn: f(mu p_hat) of the deployed mixture under the true means" in svg
    assert "Round 1 deploys the uniform mixture" in svg and "dip before the estimates sharpen" in svg
    assert "lowest: " in svg and "25th-75th percentile" in svg and "paper (mean over runs)" in svg


def test_a_long_run_reports_progress_on_stderr_when_it_is_not_a_terminal(capsys):
    # setup-b draws its means per run, so it is a long run whatever its size: progress without a terminal
    # is one line per tenth of each phase (optima, rounds), on stderr; the table is on stdout.
    assert main(["simulate", "setup-b", "--runs", "2", "--rounds", "20"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines and all(line.startswith("setup-b/default: ") for line in lines)
    assert lines[-1].startswith("setup-b/default: 20/20 rounds") and "\r" not in captured.err
    assert "2/2 runs' optima solved" in captured.err
    assert "scenario setup-b" in captured.out and "setup-b/default" not in captured.out


def test_simulate_help_lists_every_shipped_scenario_and_algorithm(capsys):
    from pasto.cli import packaged_scenarios
    from pasto.simulate import ALGORITHMS

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = capsys.readouterr().out
    for name in [*packaged_scenarios(), *ALGORITHMS]:
        assert f"\n  {name} " in text or f"\n  {name}\n" in text, name
    assert len(packaged_scenarios()) >= 10 and "default" in ALGORITHMS
