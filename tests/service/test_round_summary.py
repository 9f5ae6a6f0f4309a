"""A round's summary is one typed model (``service.responses.RoundSummary``) written by the close and
read by the store, the rounds API and the Prometheus exporter; the JSON stored and served is the one
the untyped dict made, and rows stored in an older shape still load everywhere."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from pasto.algorithm import AlgorithmConfig, initial_state
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.report import round_report
from service import store
from service.controller.reports import finite, json_safe, lift_summary, round_summary
from service.db import get_db
from service.models import Round
from service.responses import RoundSummary


def legacy_summary(algorithm, objective, state, pooled, propensities) -> dict:
    """What controller/reports.py wrote before the model: a dict, built key by key."""
    report = round_report(algorithm, objective, state, pooled, served=propensities)
    lift = lift_summary(report)
    return {
        "objective": finite(report.served.value),
        "objective_deployed": finite(report.deployed.value),
        "best_mixture": finite(report.best_mixture_value),
        "best_single": None if report.best_single_arm is None else {
            "arm_index": report.best_single_arm, "value": finite(report.best_single_value)},
        "regret": finite(report.served.regret),
        "guardrails": json_safe(list(report.served.guardrails)),
        "guardrails_deployed": json_safe(list(report.deployed.guardrails)),
        "lift": None if lift is None else {"baseline_index": lift.baseline_index, "served": lift.served,
                                           "deployed": lift.deployed},
    }


@pytest.mark.parametrize("baseline", [None, "b"])
def test_the_stored_json_is_the_dicts_key_for_key(baseline):
    spec = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]}
    if baseline is not None:
        spec["baseline"] = baseline
    objective = Objective.from_spec(["x", "y"], spec, arm_names=["a", "b"])
    config = AlgorithmConfig()
    rng = np.random.default_rng(3)
    counts = rng.integers(5, 30, (2, 2)).astype(float)
    sums = counts * np.array([[2.0, 0.0], [-2.0, 2.0]]) + rng.normal(0, 1, (2, 2))
    pooled = Statistics(counts, sums, sums ** 2 / counts + counts)
    state = initial_state(config, 2, 2, objective=objective)
    propensities = np.array([0.3, 0.7])
    typed = round_summary(config, objective, state, pooled, propensities)
    legacy = legacy_summary(config, objective, state, pooled, propensities)
    assert json.dumps(typed.to_json()) == json.dumps(legacy)  # same keys, same order, same numbers
    assert RoundSummary.load(legacy).to_json() == legacy


def play_round(api, setup_a, name: str = "summarised") -> None:
    assert api("POST", "/api/v1/experiments", json=setup_a(name)).status_code == 201
    units = [f"u{i}" for i in range(40)]
    arms = api("POST", f"/api/v1/experiments/{name}/assign", json={"units": units}).get_json()["assignments"]
    observations = [{"id": f"o{i}", "unit": a["unit"], "round": 0,
                     "values": {"x": 2.0 if a["arm"] == "a" else 0.0, "y": -2.0 if a["arm"] == "a" else 2.0}}
                    for i, a in enumerate(arms)]
    assert api("POST", f"/api/v1/experiments/{name}/observations", json={"observations": observations},
               role="ingest").status_code == 202
    assert api("POST", f"/api/v1/experiments/{name}/rounds").status_code == 200


def gauges(api) -> dict[tuple, float]:
    text = api("GET", "/metrics", role="read").get_data(as_text=True)
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith(("pasto_objective_estimate", "pasto_guardrail", "pasto_lift"))}


def test_a_row_in_the_old_shape_loads_in_the_store_the_api_and_the_exporter(api, app, setup_a):
    play_round(api, setup_a)
    before = api("GET", "/api/v1/experiments/summarised/rounds").get_json()["rounds"][0]
    with get_db(app).read() as session:
        stored = session.execute(sa.select(Round.summary).where(Round.index == 0)).scalar_one()
    assert list(stored) == ["objective", "objective_deployed", "best_mixture", "best_single", "regret",
                            "guardrails", "guardrails_deployed", "lift"]
    # A row written before objective_deployed, guardrails_deployed and lift existed.
    old = {key: stored[key] for key in ("objective", "best_mixture", "best_single", "regret", "guardrails")}
    with get_db(app).write() as session:
        session.execute(sa.update(Round).where(Round.index == 0).values(summary=old))
        experiment_id = session.execute(sa.select(Round.experiment_id).where(Round.index == 0)).scalar_one()
    after = api("GET", "/api/v1/experiments/summarised/rounds").get_json()["rounds"][0]
    for key in ("objective", "best_mixture", "best_single", "regret", "guardrails", "guardrails_served"):
        assert after[key] == before[key], key
    assert after["objective_deployed"] is None and after["guardrails_deployed"] is None and after["lift"] is None
    with get_db(app).read() as session:
        assert store.round_regrets(session, experiment_id, None) == [(0, old["regret"])]
    samples = gauges(api)
    served = ("pasto_objective_estimate", (("experiment", "summarised"), ("mixture", "served")))
    deployed = ("pasto_objective_estimate", (("experiment", "summarised"), ("mixture", "deployed")))
    assert samples[served] == pytest.approx(old["objective"]) and deployed not in samples
    assert not any(name == "pasto_guardrail_mixture_holds" and dict(labels)["mixture"] == "deployed"
                   for name, labels in samples)
