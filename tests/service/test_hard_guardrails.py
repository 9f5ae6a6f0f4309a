"""The API accepts hard guardrails, a baseline arm and the safe-serving options."""

from __future__ import annotations

import pytest


def hard_body(setup_a, **algorithm):
    return setup_a(objective={"primary": "x", "baseline": "b",
                              "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
                   algorithm={"preset": "default", **algorithm})


#: Arm a breaks y >= 0 (y = -2) and is better on x; arm b keeps it.
MEANS = {"a": (2.0, -2.0), "b": (-2.0, 2.0)}


def observe_and_close(api, units: list[str]) -> None:
    """Assign ``units``, post one observation each (MEANS plus a -0.1 / 0 / 0.1 wobble), close the round."""
    assigned = api("POST", "/api/v1/experiments/setup-a/assign", role="ingest",
                   json={"units": units}).get_json()["assignments"]
    observations = [{"id": item["unit"], "unit": item["unit"], "round": item["round"],
                     "values": {"x": MEANS[item["arm"]][0] + (i % 3 - 1) * 0.1,
                                "y": MEANS[item["arm"]][1] + (i % 3 - 1) * 0.1}}
                    for i, item in enumerate(assigned)]
    assert api("POST", "/api/v1/experiments/setup-a/observations", role="ingest",
               json={"observations": observations}).status_code == 202
    assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200


def test_hard_guardrail_baseline_and_safe_serving_are_stored(api, setup_a):
    response = api("POST", "/api/v1/experiments", json=hard_body(setup_a, serving="safe", serving_level=0.9))
    assert response.status_code == 201, response.get_json()
    experiment = response.get_json()
    assert experiment["objective"]["baseline"] == "b"
    guardrail = experiment["objective"]["guardrails"][0]
    assert guardrail["hard"] is True and not guardrail.get("penalty")
    assert experiment["algorithm"]["serving"] == "safe"
    assert experiment["algorithm"]["serving_level"] == 0.9
    # The experiment runs: a round closes with the safe serving rule.
    closed = api("POST", "/api/v1/experiments/setup-a/rounds")
    assert closed.status_code == 200, closed.get_json()
    probabilities = api("GET", "/api/v1/experiments/setup-a").get_json()["probabilities"]
    assert sum(probabilities) == pytest.approx(1.0)


@pytest.mark.parametrize("guardrail, fragment", [
    ({"metric": "y", "threshold": 0.0, "hard": True, "penalty": 1.0}, "not both"),
    ({"metric": "y", "threshold": 0.0}, "penalty"),
])
def test_invalid_guardrail_is_422_with_the_core_sentence(api, setup_a, guardrail, fragment):
    body = setup_a(objective={"primary": "x", "guardrails": [guardrail]})
    response = api("POST", "/api/v1/experiments", json=body)
    assert response.status_code == 422
    error = response.get_json()["error"]
    assert error["details"][0]["location"] == "objective"
    assert fragment in error["details"][0]["message"]
    assert error["details"][0]["message"].endswith(".")


def test_unknown_baseline_is_422(api, setup_a):
    body = setup_a(objective={"primary": "x", "baseline": "nope",
                              "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]})
    response = api("POST", "/api/v1/experiments", json=body)
    assert response.status_code == 422
    assert response.get_json()["error"]["details"][0]["location"] == "objective"
    assert "nope" in response.get_json()["error"]["details"][0]["message"]


@pytest.mark.parametrize("algorithm, fragment", [
    ({"change_level": 1.0}, "change_level"),
    ({"change_every": 0}, "change_every"),
    ({"serving": "safe", "serving_level": 1.5}, "serving_level"),
    ({"serving": "greedy"}, "serving"),
    ({"serving_holdout": 1.0}, "serving_holdout"),
    ({"serving_min_share": 0.5}, "leave no traffic"),  # K = 2: two halves leave nothing to learn with
    ({"serving_min_share": 0.45, "serving_holdout": 0.6}, "leave no traffic"),
    ({"serving": "exploration", "serving_holdout": 0.1}, "would ignore them"),
    ({"preset": "paper", "serving_min_share": 0.1}, "would ignore them"),
])
def test_invalid_serving_options_are_422(api, setup_a, algorithm, fragment):
    response = api("POST", "/api/v1/experiments", json=hard_body(setup_a, **algorithm))
    assert response.status_code == 422, response.get_json()
    detail = response.get_json()["error"]["details"][0]
    assert detail["location"] == "algorithm"
    assert fragment in detail["message"]


def test_a_holdout_and_a_minimum_share_are_served_from_the_first_round_on(api, setup_a):
    """GrowthBook users asked for both (issues 4037 and 6145 there): every arm keeps serving_min_share
    and the baseline b keeps serving_holdout in every round, the first one included, while a (x = 2,
    y = -2 against b's -2 and 2) takes what the guardrail allows."""
    body = hard_body(setup_a, serving_min_share=0.05, serving_holdout=0.3)
    response = api("POST", "/api/v1/experiments", json=body)
    assert response.status_code == 201, response.get_json()
    assert (response.get_json()["algorithm"]["serving_min_share"],
            response.get_json()["algorithm"]["serving_holdout"]) == (0.05, 0.3)
    served = [response.get_json()["probabilities"]]
    for round_index in range(4):
        observe_and_close(api, [f"r{round_index}-u{i}" for i in range(200)])
        served.append(api("GET", "/api/v1/experiments/setup-a").get_json()["probabilities"])
    for probabilities in served:
        assert probabilities[1] >= 0.3 - 1e-9 and min(probabilities) >= 0.05 - 1e-9, served
    # a is learned up to what the guardrail allows (y = 2 - 4 p_a >= 0: p_a <= 1/2), from 0.375 in round 0.
    assert 0.45 < served[-1][0] <= 0.5 + 1e-9, served


def test_hard_and_soft_guardrails_together_are_served_safely(api, setup_a):
    # Setup A: arm a (x 2, y -2), arm b (x -2, y 2). Hard: y >= 0, so p_a <= 1/2; the soft one
    # (y >= -1) never binds where the hard one holds.
    objective = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True},
                                                {"metric": "y", "threshold": -1.0, "penalty": 5.0}]}
    response = api("POST", "/api/v1/experiments", json=setup_a(objective=objective))
    assert response.status_code == 201, response.get_json()
    served = []
    for round_index in range(4):
        observe_and_close(api, [f"r{round_index}-u{i}" for i in range(200)])
        served.append(api("GET", "/api/v1/experiments/setup-a").get_json()["probabilities"])
    # Served on the hard guardrail's pessimistic bound (y = 2 - 4 p_a >= 0 on lower bounds: p_a just
    # below 1/2), and moving to it from the uniform start.
    assert all(probabilities[0] <= 0.5 + 1e-9 for probabilities in served), served
    assert served[-1][0] > 0.4, served


def test_a_holdout_needs_a_baseline(api, setup_a):
    body = setup_a(objective={"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
                   algorithm={"serving_holdout": 0.2})
    response = api("POST", "/api/v1/experiments", json=body)
    assert response.status_code == 422, response.get_json()
    detail = response.get_json()["error"]["details"][0]
    assert detail["location"] == "algorithm" and "needs a baseline arm" in detail["message"]
    assert api("GET", "/api/v1/experiments/setup-a").status_code == 404  # nothing half-written


@pytest.mark.parametrize("estimator", ["ips", "control_variate"])
def test_a_configuration_overriding_the_estimator_serves_safely_by_default(api, setup_a, estimator):
    """Safe serving is the default and takes its bounds from its own pooled statistics, so an
    experiment that overrides the estimator is created and its rounds close."""
    response = api("POST", "/api/v1/experiments", json=hard_body(setup_a, estimator=estimator))
    assert response.status_code == 201, response.get_json()
    assert response.get_json()["algorithm"]["serving"] == "safe"
    assert response.get_json()["algorithm"]["estimator"] == estimator
    for _ in range(3):
        assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200
    probabilities = api("GET", "/api/v1/experiments/setup-a").get_json()["probabilities"]
    assert sum(probabilities) == pytest.approx(1.0)


def test_hard_guardrail_type_errors_name_the_field(api, setup_a):
    body = setup_a(objective={"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": "yes"}]})
    response = api("POST", "/api/v1/experiments", json=body)
    assert response.status_code == 422
    assert response.get_json()["error"]["details"][0]["location"] == "objective.guardrails[0].hard"


def test_rounds_and_diagnostics_report_served_and_deployed_guardrails(api, setup_a):
    """Arm a breaks y >= 0 (y = -2), arm b keeps it (y = 2): the served traffic of round 0 (half and
    half) holds on the estimate; the reports say so for served and deployed alike, with intervals."""
    assert api("POST", "/api/v1/experiments", json=hard_body(setup_a, serving="safe")).status_code == 201
    observe_and_close(api, [f"u{i}" for i in range(400)])
    rounds = api("GET", "/api/v1/experiments/setup-a/rounds", role="read").get_json()["rounds"]
    closed = rounds[0]
    (served,) = closed["guardrails_served"]
    (deployed,) = closed["guardrails_deployed"]
    assert served == closed["guardrails"][0]
    # Round 0 served p = (1/2, 1/2): y = 0 on the estimate, up to the noise's mean.
    assert served["estimate"] == pytest.approx(0.0, abs=0.1)
    assert served["interval"][0] < served["estimate"] < served["interval"][1]
    assert deployed["metric"] == "y" and deployed["threshold"] == 0.0
    probabilities, deployed_mixture = closed["probabilities"], closed["deployed"]
    assert deployed["estimate"] == pytest.approx(
        -2.0 * deployed_mixture[0] + 2.0 * deployed_mixture[1], abs=0.1)
    assert served["estimate"] == pytest.approx(-2.0 * probabilities[0] + 2.0 * probabilities[1], abs=0.1)
    diagnostics = api("GET", "/api/v1/experiments/setup-a/diagnostics", role="read").get_json()
    assert diagnostics["guardrails"] == diagnostics["guardrails_deployed"]
    served_now = rounds[1]["probabilities"]
    assert diagnostics["guardrails_served"][0]["estimate"] == pytest.approx(
        -2.0 * served_now[0] + 2.0 * served_now[1], abs=0.1)
    # Safe serving keeps the hard guardrail's lower bound for the traffic served next.
    assert diagnostics["guardrails_served"][0]["holds"] is True


def test_lift_over_the_baseline_in_rounds_diagnostics_and_metrics(api, setup_a):
    """Arm a: x = 2, arm b (the baseline): x = -2. The lift of a mixture p on x is 4 p_a on the
    estimate, with the interval the per-arm standard errors give; the same values reach Prometheus."""
    from tests.service.test_monitoring import by_label, scrape

    assert api("POST", "/api/v1/experiments", json=hard_body(setup_a, serving="safe")).status_code == 201
    observe_and_close(api, [f"u{i}" for i in range(400)])
    closed = api("GET", "/api/v1/experiments/setup-a/rounds", role="read").get_json()["rounds"][0]
    lift = closed["lift"]
    assert lift["baseline"] == "b"
    for mixture, probabilities in (("served", closed["probabilities"]), ("deployed", closed["deployed"])):
        primary = lift[mixture]["primary"]
        assert primary["estimate"] == pytest.approx(4.0 * probabilities[0], abs=0.02)
        low, high = primary["interval"]
        assert low <= primary["estimate"] <= high
        # Hard guardrails take no part in f: the objective is x alone, so both lifts agree.
        assert lift[mixture]["objective"] == primary
        # The baseline's x is negative: a share of it means nothing.
        assert primary["relative"] is None and primary["relative_interval"] == [None, None]
    if closed["probabilities"][0] > 0:
        assert lift["served"]["primary"]["interval"][0] > 0  # 400 observations: clearly above the baseline
    diagnostics = api("GET", "/api/v1/experiments/setup-a/diagnostics", role="read").get_json()
    assert diagnostics["lift"]["baseline"] == "b"
    assert diagnostics["lift"]["deployed"] == lift["deployed"]  # the same estimate, the same mixture
    samples = scrape(api)
    for mixture in ("served", "deployed"):
        values = by_label(samples["pasto_lift"], "bound", experiment="setup-a", mixture=mixture, measure="primary")
        expected = lift[mixture]["primary"]
        assert values == pytest.approx({"estimate": expected["estimate"], "lower": expected["interval"][0],
                                        "upper": expected["interval"][1]}, rel=1e-12)
    assert not [sample for sample in samples.get("pasto_lift_relative", [])
                if sample.labels["experiment"] == "setup-a"]


def test_no_baseline_means_no_lift(api, setup_a):
    from tests.service.test_monitoring import scrape

    body = setup_a(objective={"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
                   algorithm={"preset": "default", "serving": "safe"})
    assert api("POST", "/api/v1/experiments", json=body).status_code == 201
    assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200
    (closed, _) = api("GET", "/api/v1/experiments/setup-a/rounds", role="read").get_json()["rounds"]
    assert closed["lift"] is None
    assert api("GET", "/api/v1/experiments/setup-a/diagnostics", role="read").get_json()["lift"] is None
    assert not [sample for sample in scrape(api).get("pasto_lift", []) if sample.labels["experiment"] == "setup-a"]


SHADOW_OBJECTIVE = {"primary": "x", "guardrails": [
    # Binding: arm a has the better x but y = -2 < (1 - 0.5) * y_b = 1 (relative to arm b, y_b = 2).
    {"metric": "y", "threshold": -0.5, "relative_to": "b", "hard": True},
    {"metric": "w", "threshold": 0.0, "penalty": 5.0},  # soft: no shadow price
    {"metric": "z", "threshold": -5.0, "hard": True},  # z = 0 on both arms: does not bind
]}


def shadow_experiment(api, setup_a, objective=SHADOW_OBJECTIVE) -> dict:
    """Setup A with metrics z and w as well, observed 400 times; its diagnostics."""
    body = setup_a(metrics=["x", "y", "z", "w"], objective=objective)
    assert api("POST", "/api/v1/experiments", json=body).status_code == 201
    assigned = api("POST", "/api/v1/experiments/setup-a/assign", role="ingest",
                   json={"units": [f"u{i}" for i in range(400)]}).get_json()["assignments"]
    means = {"a": (2.0, -2.0, 0.0, 1.0), "b": (-2.0, 2.0, 0.0, 1.0)}
    observations = [{"id": item["unit"], "unit": item["unit"], "round": item["round"],
                     "values": {metric: means[item["arm"]][m] + (i % 3 - 1) * 0.1
                                for m, metric in enumerate(("x", "y", "z", "w"))}}
                    for i, item in enumerate(assigned)]
    assert api("POST", "/api/v1/experiments/setup-a/observations", role="ingest",
               json={"observations": observations}).status_code == 202
    response = api("GET", "/api/v1/experiments/setup-a/diagnostics", role="read")
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def test_diagnostics_report_each_hard_guardrails_shadow_price(api, setup_a):
    """The shadow price of a hard guardrail is what lowering its (resolved) threshold by one unit would add
    to the best mixture's value: checked against a finite difference of pasto.optimum.solve on the same
    point estimates. A hard guardrail that does not bind is worth 0; a soft one has no price (null)."""
    import numpy as np

    from pasto.objectives import Objective
    from pasto.optimum import solve

    diagnostics = shadow_experiment(api, setup_a)
    prices = diagnostics["best_mixture"]["shadow_prices"]
    assert [(item["metric"], item["hard"]) for item in prices] == [("y", True), ("w", False), ("z", True)]
    assert [item["metric"] for item in prices] == [item["metric"] for item in diagnostics["guardrails"]]
    # The point estimates the diagnostics solved on, and the thresholds resolved on them.
    estimate = diagnostics["estimate"]["means"]
    means = np.array([estimate[metric] for metric in ("x", "y", "z", "w")])
    objective = Objective.from_spec(["x", "y", "z", "w"], SHADOW_OBJECTIVE, arm_names=["a", "b"])
    thresholds = objective.thresholds(means)
    assert thresholds[0] == pytest.approx(diagnostics["guardrails"][0]["threshold"], rel=1e-12)
    base = solve(objective, means, thresholds)
    assert base.value == pytest.approx(diagnostics["best_mixture"]["value"], rel=1e-12)
    step = 1e-6
    relaxed = thresholds.copy()
    relaxed[0] -= step
    gained = (solve(objective, means, relaxed).value - base.value) / step
    assert gained > 0.5  # it binds
    assert prices[0]["shadow_price"] == pytest.approx(gained, rel=1e-4)
    assert prices[2]["shadow_price"] == 0.0
    relaxed = thresholds.copy()
    relaxed[2] -= step
    assert solve(objective, means, relaxed).value == pytest.approx(base.value, abs=1e-12)
    assert prices[1]["shadow_price"] is None
    # Nowhere else: the deployed and served guardrails have no price (it belongs to the optimum).
    assert all("shadow_price" not in item for item in diagnostics["guardrails"] + diagnostics["guardrails_served"])


def test_shadow_prices_are_null_when_no_mixture_meets_the_hard_guardrails(api, setup_a):
    objective = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 5.0, "hard": True},
                                                {"metric": "z", "threshold": -5.0, "hard": True}]}
    prices = shadow_experiment(api, setup_a, objective)["best_mixture"]["shadow_prices"]
    assert prices == [{"metric": "y", "hard": True, "shadow_price": None},
                      {"metric": "z", "hard": True, "shadow_price": None}]


def test_a_cached_optimum_without_shadow_prices_is_solved_again(api, setup_a, monkeypatch):
    """The optimum cache (service.controller.reports.cached_solver) may hold an optimum made without shadow
    prices (by a solve that did not keep them): it is not served as is, but solved again."""
    import dataclasses

    from service.controller import reports

    real = reports.solve_optimum
    calls = []

    def older(*args):
        calls.append("older")
        return dataclasses.replace(real(*args), shadow_prices=None)

    monkeypatch.setattr(reports, "solve_optimum", older)
    diagnostics = shadow_experiment(api, setup_a)
    assert [item["shadow_price"] for item in diagnostics["best_mixture"]["shadow_prices"]] == [None, None, None]

    def current(*args):
        calls.append("current")
        return real(*args)

    monkeypatch.setattr(reports, "solve_optimum", current)
    again = api("GET", "/api/v1/experiments/setup-a/diagnostics", role="read").get_json()
    assert calls == ["older", "current"]
    assert again["best_mixture"]["shadow_prices"][0]["shadow_price"] > 0.5
    assert again["best_mixture"]["value"] == diagnostics["best_mixture"]["value"]
    api("GET", "/api/v1/experiments/setup-a/diagnostics", role="read")
    assert calls == ["older", "current"]  # and kept
