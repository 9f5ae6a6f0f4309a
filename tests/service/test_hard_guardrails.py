"""The API accepts hard guardrails, a baseline arm and the safe-serving options (issue 14)."""

from __future__ import annotations

import pytest


def hard_body(setup_a, **algorithm):
    return setup_a(objective={"primary": "x", "baseline": "b",
                              "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
                   algorithm={"preset": "default", **algorithm})


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
])
def test_invalid_serving_options_are_422(api, setup_a, algorithm, fragment):
    response = api("POST", "/api/v1/experiments", json=hard_body(setup_a, **algorithm))
    assert response.status_code == 422, response.get_json()
    detail = response.get_json()["error"]["details"][0]
    assert detail["location"] == "algorithm"
    assert fragment in detail["message"]


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
    assigned = api("POST", "/api/v1/experiments/setup-a/assign", role="ingest",
                   json={"units": [f"u{i}" for i in range(400)]}).get_json()["assignments"]
    means = {"a": (2.0, -2.0), "b": (-2.0, 2.0)}
    observations = [{"id": item["unit"], "unit": item["unit"], "round": item["round"],
                     "values": {"x": means[item["arm"]][0] + (i % 3 - 1) * 0.1,
                                "y": means[item["arm"]][1] + (i % 3 - 1) * 0.1}}
                    for i, item in enumerate(assigned)]
    assert api("POST", "/api/v1/experiments/setup-a/observations", role="ingest",
               json={"observations": observations}).status_code == 202
    assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200
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
