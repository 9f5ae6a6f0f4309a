"""Bad scenario files and bad CLI arguments: each is a clear error that names the key or option."""

from __future__ import annotations

import json
import re

import pytest

from pasto.cli import load_scenario, main
from pasto.scenario import scenario_from_dict


def document(**changes):
    base = {
        "name": "tiny",
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "arms": {"means": [[2.0, 0.0], [-2.0, 2.0]]},
        "noise": {"kind": "gaussian", "std": 1.0},
        "rounds": 50,
    }
    base.update(changes)
    return base


def without(key):
    base = document()
    del base[key]
    return base


CASES = [
    (without("name"), "Missing required key name"),
    (without("metrics"), "Missing required key metrics"),
    (without("objective"), "Missing required key objective"),
    (without("arms"), "Missing required key arms"),
    (without("noise"), "Missing required key noise"),
    (without("rounds"), "Missing required key rounds"),
    (document(rouns=5), "Unknown key rouns in scenario"),
    (document(name=""), "name must be a non-empty string"),
    (document(description=3), "description must be a string"),
    (document(metrics=[]), "metrics must be a non-empty list"),
    (document(metrics=["x", 3]), r"metrics\[1\] must be a non-empty string"),
    (document(metrics=["x", "x"]), "metrics names 'x' more than once"),
    (document(arms=[[1.0]]), "arms must be an object"),
    (document(arms={"mean": [[1, 2], [3, 4]]}), "Unknown key arms.mean in arms"),
    (document(arms={"means": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]}),
     "arms.means has 3 rows but metrics names 2 metrics."),
    (document(arms={"means": [[1.0, 2.0], [3.0]]}), r"arms.means\[1\] has 1 entries but arms.means\[0\] has 2"),
    (document(arms={"means": [[1.0, "a"], [3.0, 4.0]]}), r"arms.means\[0\]\[1\] must be a finite number"),
    (document(arms={"means": [[1.0], [3.0]]}), "at least 2 arms"),
    (document(arms={"count": 3, "means": [[1.0, 2.0], [3.0, 4.0]]}), "arms.count is 3 but arms.means has 2 columns"),
    (document(arms={"means": {"uniform": [-1, 1]}}), "arms.count is required"),
    (document(arms={"count": 1, "means": {"uniform": [-1, 1]}}), "arms.count must be at least 2"),
    (document(arms={"count": 5, "means": {"uniform": [1, -1]}}), "arms.means.uniform must have low < high"),
    (document(arms={"count": 5, "means": {"uniform": [1]}}), r"arms.means.uniform must be a list \[low, high\]"),
    (document(arms={"count": 5, "means": {"normal": [0, 1]}}), "Unknown key arms.means.normal"),
    (document(noise={"kind": "cauchy", "std": 1.0}), "noise.kind must be one of gaussian, student_t, lognormal, bernoulli"),
    (document(noise={"kind": ["gaussian"], "std": 1.0}), "noise.kind has 1 entries but metrics names 2 metrics"),
    (document(noise={"kind": ["gaussian", "cauchy"], "std": 1.0}), "noise.kind\\[1\\] must be one of"),
    (document(noise={"kind": ["bernoulli", "gaussian"], "std": 1.0}), "noise.std must be 0 for a bernoulli metric"),
    (document(noise={"kind": ["gaussian", "bernoulli"], "std": [1.0, 0.2]}), "noise.std\\[1\\] must be 0 for a bernoulli"),
    (document(noise={"kind": ["bernoulli", "student_t"], "std": [0.0, 1.0]}), "noise.df is required"),
    (document(noise={"kind": ["gaussian", "bernoulli"], "std": [1.0, 0.0]}),
     "arms.means of metric 'y' can be -2, but its noise.kind is bernoulli"),
    (document(noise={"kind": "gaussian"}), "Missing required key noise.std"),
    (document(noise={"kind": "gaussian", "std": -1.0}), "noise.std must be non-negative"),
    (document(noise={"kind": "gaussian", "std": [1.0, 1.0, 1.0]}), "noise.std has 3 entries but metrics names 2"),
    (document(noise={"kind": "gaussian", "std": "big"}), "noise.std must be a finite number"),
    (document(noise={"kind": "student_t", "std": 1.0}), "noise.df is required"),
    (document(noise={"kind": "student_t", "std": 1.0, "df": 2}), "noise.df must be greater than 2"),
    (document(noise={"kind": "gaussian", "std": 1.0, "df": 4}), "noise.df only applies to noise.kind student_t"),
    (document(noise={"kind": "gaussian", "std": 1.0, "scale": 4}), "Unknown key noise.scale"),
    (document(rounds=0), "rounds must be at least 1"),
    (document(rounds=2.5), "rounds must be an integer"),
    (document(rounds=True), "rounds must be an integer, not the boolean true"),
    (document(runs=0), "runs must be at least 1"),
    (document(seed=-1), "seed must be at least 0"),
    (document(queries_per_round=0), "queries_per_round must be at least 1"),
    (document(checkpoints=[]), "checkpoints must be a non-empty list"),
    (document(checkpoints=[10, 5]), r"checkpoints must be strictly increasing; checkpoints\[1\] is 5"),
    (document(checkpoints=[10, 60]), r"checkpoints\[1\] is 60, beyond rounds \(50\)"),
    (document(checkpoints=[0]), r"checkpoints\[0\] must be at least 1"),
    (document(delay_rounds=-1), "delay_rounds must be at least 0"),
    (document(delay_rounds=50), "delay_rounds is 50 but the scenario has only 50 rounds"),
    (document(drift={"at_round": 10}), "Missing required key drift.means"),
    (document(drift={"at_round": 1, "means": [[0, 1], [1, 0]]}), "drift.at_round must be at least 2"),
    (document(drift={"at_round": 10, "means": [[0, 1, 2], [1, 0, 2]]}), "drift.means has 3 columns but arms has 2 arms"),
    (document(drift={"at_round": 10, "means": [[0, 1]]}), "drift.means has 1 rows but metrics names 2 metrics"),
    (document(drift={"at_round": 10, "means": [[0, 1], [1, 0]], "when": 3}), "Unknown key drift.when"),
    (document(objective="x"), "objective must be an object"),
    (document(objective={"guardrails": []}), "Missing required key objective.primary"),
    (document(objective={"primary": "x", "weights": 1}), "Unknown key objective.weights"),
    (document(objective={"primary": "z"}), "objective: Primary metric 'z' is not one of the metrics"),
    (document(objective={"primary": "x", "guardrails": {"metric": "y"}}), "objective.guardrails must be a list"),
    (document(objective={"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0}]}),
     r"objective: Guardrail 0 is missing the required key .penalty. \(a soft guardrail.s weight\); give .hard.: true"),
    (document(objective={"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 0.0, "penalty": 1.0, "limit": 2}]}),
     r"Unknown key objective.guardrails\[0\].limit"),
    (document(objective={"primary": "x", "guardrails": [{"metric": "w", "threshold": 0.0, "penalty": 1.0}]}),
     "objective: Guardrail 0 .metric 'w'. refers to an unknown metric"),
    (document(objective={"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 0.0, "penalty": 1.0, "relative_to": "control"}]}),
     "objective: .*relative_to.*'control'"),
]


@pytest.mark.parametrize(("data", "message"), CASES, ids=[message[:40] for _, message in CASES])
def test_invalid_scenario_names_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        scenario_from_dict(data)


def test_a_scenario_must_be_an_object():
    with pytest.raises(ValueError, match="A scenario must be a JSON object, not a list of 0 entries"):
        scenario_from_dict([])


def test_invalid_json_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": ')
    with pytest.raises(ValueError, match=f"The scenario in {re.escape(str(path))} is not valid JSON"):
        load_scenario(path)


def test_unknown_scenario_name_lists_the_packaged_ones():
    with pytest.raises(ValueError, match="no packaged scenario of that name; packaged scenarios: demo, demo-soft, online-hard, online-hard-wide, online-mixed, online-soft, online-soft-wide, segments-global-guardrail, segments-zipf, setup-a, setup-a-drift, setup-b, setup-b-hard"):
        load_scenario("setup-z")


def run_cli(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse reports usage errors by exiting
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "setup-a", "--runs", "0"], "argument --runs: expected a positive integer, got 0"),
        (["simulate", "setup-a", "--runs", "many"], "argument --runs: expected a positive integer, got 'many'"),
        (["simulate", "setup-a", "--rounds", "-3"], "argument --rounds: expected a positive integer"),
        (["simulate", "setup-a", "--seed", "-1"], "argument --seed: expected a non-negative integer"),
        (["simulate", "setup-a", "--noise-std", "loud"], "argument --noise-std: expected a number"),
        (["simulate", "setup-a", "--algorithm", "ucb"], "argument --algorithm: invalid choice: 'ucb'"),
        (["simulate", "setup-a", "--set", "novalue"], "--set expects key=value, got 'novalue'"),
        (["simulate", "setup-a", "--set", "=3"], "--set expects key=value"),
        (["simulate", "setup-a", "--algorithm", "scgd", "--set", "nonsense=1"], "Unknown ScgdConfig setting 'nonsense'"),
        (["simulate", "setup-a", "--algorithm", "paper", "--set", "nonsense=1"], "Unknown algorithm setting 'nonsense'"),
        (["simulate", "setup-a", "--algorithm", "scgd", "--set", "tracking_exponent=2"],
         r"ScgdConfig.tracking_exponent must be in \(0, 1\]"),
        (["simulate", "setup-a", "--algorithm", "thompson", "--set", "draws=0"], "ThompsonConfig.draws must be a positive integer"),
        (["simulate", "setup-a", "--set", "a=1", "--set", "a=2"], "--set a is given more than once"),
        (["simulate", "no-such-scenario"], "no packaged scenario of that name"),
        (["simulate", "setup-a", "--rounds", "10", "--out", "/nonexistent/dir/out.json"],
         "--out /nonexistent/dir/out.json: the directory /nonexistent/dir does not exist"),
        (["simulate", "setup-a", "--rounds", "10", "--plot", "curve.txt"], "--plot curve.txt must end in .png, .pdf or .svg"),
        (["simulate"], "the following arguments are required: scenario"),
    ],
)
def test_invalid_cli_arguments(argv, message, capsys):
    status, out, err = run_cli(argv, capsys)
    assert status == 2
    assert re.search(message, err), err
    assert out == ""


def test_invalid_scenario_file_through_the_cli(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document(arms={"means": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]})))
    status, out, err = run_cli(["simulate", str(path)], capsys)
    assert status == 2
    assert "pasto simulate: error: arms.means has 3 rows but metrics names 2 metrics." in err
