"""Every error path of the HTTP contract: a 4xx JSON error saying what was wrong, nothing written."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from service.db import get_db
from service.models import ArmRoundCount, Experiment, ObservationId, RoundStatistic, RoundUnit
from tests.service.conftest import setup_a_body

EXPERIMENTS = "/api/v1/experiments"
ASSIGN = "/api/v1/experiments/setup-a/assign"
OBSERVATIONS = "/api/v1/experiments/setup-a/observations"


@pytest.fixture
def created(api, setup_a):
    response = api("POST", EXPERIMENTS, json=setup_a())
    assert response.status_code == 201
    return response.get_json()


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    assert response.is_json
    error = response.get_json()["error"]
    assert set(error) == {"code", "message", "details"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def observation(**overrides):
    item = {"id": "o1", "unit": "u1", "round": 0, "values": {"x": 1.0, "y": 2.0}}
    item.update(overrides)
    return item


def count_rows(app, model) -> int:
    with get_db(app).read() as session:
        return session.execute(sa.select(sa.func.count()).select_from(model)).scalar_one()


# ------------------------------------------------------------------------- generic HTTP errors
def test_unknown_url_is_a_json_404(api):
    assert error_of(api("GET", "/api/v1/nothing"), 404)["code"] == "not_found"


@pytest.mark.parametrize("length", [65, 129, 5000])
def test_an_experiment_name_in_the_path_over_the_limit_is_404_saying_the_limit(api, created, length):
    """Experiment names are at most 64 characters (every name in a path is one): the message says so."""
    for method, suffix in (("GET", ""), ("POST", "/assign"), ("GET", "/diagnostics")):
        error = error_of(api(method, f"{EXPERIMENTS}/{'a' * length}{suffix}", json={"unit": "u"}), 404)
        assert error["code"] == "not_found"
        assert error["message"] == (f"Nothing here: an experiment name is at most 64 characters, "
                                    f"this one has {length:,}.")


def test_an_experiment_name_of_the_longest_length_is_served(api, setup_a):
    name = "a" * 64
    assert api("POST", EXPERIMENTS, json=setup_a(name)).status_code == 201
    assert api("GET", f"{EXPERIMENTS}/{name}", role="read").get_json()["name"] == name
    assert api("POST", EXPERIMENTS, json=setup_a(name + "a")).status_code == 422


def test_wrong_method_is_a_json_405(api, created):
    error = error_of(api("PUT", "/api/v1/experiments/setup-a"), 405)  # DELETE is allowed (admin): delete
    assert error["code"] == "method_not_allowed"
    assert {"GET", "DELETE"} <= set(error["details"]["allowed_methods"])


@pytest.mark.parametrize("method, suffix", [
    ("GET", ""), ("POST", "/assign"), ("POST", "/observations"), ("POST", "/statistics"), ("GET", "/rounds"),
    ("POST", "/rounds"),
    ("GET", "/diagnostics"), ("POST", "/pause"), ("POST", "/resume"), ("POST", "/stop"), ("POST", "/archive"),
    ("DELETE", ""),
])
def test_unknown_experiment_is_404(api, method, suffix):
    bodies = {"/assign": {"unit": "u"}, "/observations": {"observations": [observation()]},
              "/statistics": {"batch_id": "b", "cells": [{"round": 0, "arm": "a", "metric": "x", "count": 1, "sum": 1.0,
                                                          "sum_of_squares": 1.0}]}}
    body = bodies.get(suffix)
    error = error_of(api(method, f"/api/v1/experiments/nope{suffix}", json=body), 404)
    assert "nope" in error["message"]


def test_huge_payload_is_413(api, app, created):
    app.config["MAX_CONTENT_LENGTH"] = 1024
    body = {"units": [f"unit-{i}" for i in range(1000)]}
    assert error_of(api("POST", ASSIGN, json=body), 413)["code"] == "request_entity_too_large"


def test_body_that_is_not_json_is_415(api, created):
    response = api("POST", ASSIGN, data="unit=u1", content_type="application/x-www-form-urlencoded")
    assert error_of(response, 415)["code"] == "unsupported_media_type"


def test_malformed_json_is_400(api, created):
    error = error_of(api("POST", ASSIGN, data="{\"unit\": ", content_type="application/json"), 400)
    assert "JSON" in error["message"]


def test_absurdly_nested_json_is_400(api, created):
    response = api("POST", ASSIGN, data="[" * 100_000, content_type="application/json")
    assert "nests" in error_of(response, 400)["message"]


# A key twice in one object (raw texts: json.dumps cannot write them), on every route with a JSON body
# but the two ingestion routes (test below): (path, text, location of the repeated key). Python's
# parser, like pydantic's, would keep the last value.
_SETUP_A_TEXT = json.dumps(setup_a_body("second"))
REPEATED_KEYS = [
    (ASSIGN, '{"unit": "x", "unit": "y"}', "unit"),
    (ASSIGN, '{"units": ["x"], "units": ["y"]}', "units"),
    (ASSIGN, '{"unit": "x", "units": ["y"], "unit": "x"}', "unit"),  # not next to each other
    (EXPERIMENTS, _SETUP_A_TEXT.replace('"name": "second"', '"name": "second", "name": "third"'), "name"),
    (EXPERIMENTS, _SETUP_A_TEXT.replace('"weight": 1.0', '"weight": 1.0, "weight": 2.0'), "arms[0].params.weight"),
    ("/api/v1/experiments/setup-a/rounds", '{"round": 5, "round": 0}', "round"),
]


@pytest.mark.parametrize("path, text, location", REPEATED_KEYS, ids=[f"{path.rsplit('/', 1)[-1]}:{location}"
                                                                      for path, _, location in REPEATED_KEYS])
def test_a_repeated_key_is_400_naming_it(api, app, created, path, text, location):
    before = {model: count_rows(app, model) for model in (Experiment, ObservationId, RoundStatistic, ArmRoundCount)}
    round_before = api("GET", "/api/v1/experiments/setup-a", role="read").get_json()["round"]
    error = error_of(api("POST", path, data=text, content_type="application/json"), 400)
    key = location.rsplit(".", 1)[-1]
    assert error["code"] == "duplicate_key"
    assert error["details"] == [{"location": location, "message": f"Duplicate key {key!r}: a key may appear only "
                                                                  f"once in an object."}]
    assert error["message"] == f"{location}: Duplicate key {key!r}: a key may appear only once in an object."
    # Nothing written, no round closed.
    assert {model: count_rows(app, model) for model in before} == before
    assert api("GET", "/api/v1/experiments/setup-a", role="read").get_json()["round"] == round_before


def test_the_first_object_with_a_repeated_key_is_named(api, created):
    """Body order: the object that opens first (an outer one before the objects inside it), then its
    first key seen twice."""
    text = (_SETUP_A_TEXT.replace('"weight": 1.0', '"weight": 1.0, "weight": 2.0')
            .replace('"name": "second"', '"name": "second", "name": "third"'))
    error = error_of(api("POST", EXPERIMENTS, data=text, content_type="application/json"), 400)
    assert [detail["location"] for detail in error["details"]] == ["name"]  # the outer object opens first
    text = '{"unit": "x", "units": [], "units": [], "unit": "y"}'
    error = error_of(api("POST", ASSIGN, data=text, content_type="application/json"), 400)
    assert [detail["location"] for detail in error["details"]] == ["units"]


def test_the_ingestion_routes_keep_the_last_value_of_a_repeated_key(api, app, created):
    """The hot path validates straight from the bytes (schemas.parse_json), whose parser keeps a
    repeated key's last value; docs/api.md says so."""
    text = '{"observations": [{"id": "o1", "unit": "u1", "round": 0, "values": {"x": 1, "x": 3}}]}'
    assert api("POST", OBSERVATIONS, data=text, content_type="application/json").status_code == 202
    with get_db(app).read() as session:
        stored = session.execute(sa.select(RoundStatistic.count, RoundStatistic.sum)).all()
    assert [tuple(row) for row in stored] == [(1, 3.0)]


def test_equal_keys_in_different_objects_are_fine(api, created):
    text = ('{"observations": [{"id": "o1", "unit": "u1", "round": 0, "values": {"x": 1, "y": 1}}, '
            '{"id": "o2", "unit": "u2", "round": 0, "values": {"x": 1, "y": 2}}]}')
    response = api("POST", OBSERVATIONS, data=text, content_type="application/json")
    assert response.status_code == 202, response.get_data(as_text=True)
    # Escapes are decoded before keys are compared: "\u0075nit" is "unit".
    error = error_of(api("POST", ASSIGN, data='{"unit": "a", "\\u0075nit": "b"}', content_type="application/json"),
                     400)
    assert error["details"][0]["location"] == "unit"


@pytest.mark.parametrize("body", [[1, 2], "u1", 3, None])
def test_body_must_be_an_object(api, created, body):
    response = api("POST", ASSIGN, data=json.dumps(body), content_type="application/json")
    assert error_of(response, 422)["details"][0]["location"] == "body"


# ------------------------------------------------------------------------- experiment creation
@pytest.mark.parametrize("change, location", [
    ({"name": "Bad Name"}, "name"),
    ({"name": "x" * 65}, "name"),
    ({"name": ""}, "name"),
    ({"arms": [{"name": "a", "params": {}}]}, "arms"),
    ({"arms": [{"name": "a"}, {"name": "a"}]}, "arms[1].name"),
    ({"arms": [{"name": "a", "params": []}, {"name": "b"}]}, "arms[0].params"),
    ({"arms": [{"name": "a", "extra": 1}, {"name": "b"}]}, "arms[0].extra"),
    ({"arms": [{"name": "a", "params": {"w": float("nan")}}, {"name": "b"}]}, "arms[0].params"),
    ({"arms": [{"name": "a", "params": {"w": ["ok", "nul\u0000"]}}, {"name": "b"}]}, "arms[0].params"),
    ({"arms": [{"name": "a", "params": {"w": 1e308 * 10}}, {"name": "b"}]}, "arms[0].params"),
    ({"metrics": []}, "metrics"),
    ({"metrics": ["x", "x", "y"]}, "metrics[1]"),
    ({"metrics": ["x", 3]}, "metrics[1]"),
    ({"objective": {"primary": "z", "guardrails": []}}, "objective"),
    ({"objective": {"primary": "x", "guardrails": [{"metric": "w", "threshold": 0, "penalty": 1}]}}, "objective"),
    ({"objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0, "penalty": -1}]}},
     "objective.guardrails[0].penalty"),
    ({"objective": {"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 0, "penalty": 1, "relative_to": "nope"}]}}, "objective"),
    ({"round_seconds": 0.5}, "round_seconds"),
    ({"round_seconds": "60"}, "round_seconds"),
    ({"round_seconds": True}, "round_seconds"),
    ({"settle_seconds": -1}, "settle_seconds"),
    ({"round_seconds": 1e300}, "round_seconds"),
    ({"settle_seconds": 1e12}, "settle_seconds"),
    ({"objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 1e300, "penalty": 1}]}},
     "objective.guardrails[0].threshold"),
    ({"algorithm": {"preset": "fastest"}}, "algorithm.preset"),
    ({"algorithm": {"preset": "default", "no_such_option": 1}}, "algorithm"),
    ({"algorithm": {"preset": "default", "estimator": "magic"}}, "algorithm"),
    # an option of the serving rule not chosen would do nothing: safe serving has no step size
    ({"algorithm": {"preset": "default", "step_size": 0.5}}, "algorithm"),
    ({"algorithm": {"preset": "paper", "change_level": 0.05}}, "algorithm"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"unexpected": 1}, "unexpected"),
])
def test_invalid_experiment_is_422_naming_the_item(api, app, setup_a, change, location):
    body = json.dumps(setup_a(**change))  # json.dumps writes NaN/Infinity, as careless clients do
    error = error_of(api("POST", EXPERIMENTS, data=body, content_type="application/json"), 422)
    assert error["code"] == "invalid_request"
    assert error["details"][0]["location"] == location, error
    assert error["message"].startswith(location)
    assert count_rows(app, Experiment) == 0


@pytest.mark.parametrize("change, location, sentence", [
    ({"arms": [{"name": "a"}, {"name": "b"}, {"name": "a"}]}, "arms[2].name",
     "Duplicate arm name 'a' (first at arms[0])."),
    ({"metrics": ["x", "y", "y"]}, "metrics[2]", "Duplicate metric 'y' (first at metrics[1])."),
])
def test_duplicate_name_message_and_details_agree(api, setup_a, change, location, sentence):
    error = error_of(api("POST", EXPERIMENTS, json=setup_a(**change)), 422)
    assert error["message"] == f"{location}: {sentence}"
    assert error["details"] == [{"location": location, "message": sentence}]


@pytest.mark.parametrize("missing", ["name", "arms", "metrics", "objective", "round_seconds"])
def test_missing_experiment_field_is_422(api, setup_a, missing):
    body = setup_a()
    del body[missing]
    assert error_of(api("POST", EXPERIMENTS, json=body), 422)["details"][0]["location"] == missing


def test_non_finite_threshold_is_422(api, setup_a):
    body = json.dumps(setup_a()).replace('"threshold": 0.0', '"threshold": NaN')
    error = error_of(api("POST", EXPERIMENTS, data=body, content_type="application/json"), 422)
    assert error["details"][0]["location"] == "objective.guardrails[0].threshold"


def test_duplicate_experiment_name_is_409(api, app, setup_a, created):
    error = error_of(api("POST", EXPERIMENTS, json=setup_a()), 409)
    assert error["code"] == "conflict" and "setup-a" in error["message"]
    assert count_rows(app, Experiment) == 1


# ------------------------------------------------------------------------- assignment
@pytest.mark.parametrize("body, location", [
    ({}, "unit"),
    ({"unit": ""}, "unit"),
    ({"unit": 42}, "unit"),
    ({"unit": None}, "unit"),
    ({"unit": "u\u0000"}, "unit"),
    ({"unit": "x" * 257}, "unit"),
    ({"units": []}, "units"),
    ({"units": "u1"}, "units"),
    ({"units": ["u1", 2]}, "units[1]"),
    ({"units": ["u1"], "unit": "u2"}, "unit"),
    ({"unit": "u1", "round": 3}, "round"),
])
def test_invalid_assign_is_422(api, created, body, location):
    error = error_of(api("POST", ASSIGN, json=body), 422)
    assert error["details"][0]["location"] == location, error


@pytest.mark.parametrize("body, words", [
    ({}, "Field required: send either unit (one unit id) or units (a list of unit ids)."),
    ({"units": ["u1"], "unit": "u2"}, "Send either unit (one unit id) or units (a list of unit ids), not both."),
])
def test_assign_says_to_send_exactly_one_of_unit_or_units(api, created, body, words):
    error = error_of(api("POST", ASSIGN, json=body), 422)
    assert error["details"] == [{"location": "unit", "message": words}]


def test_lone_surrogate_unit_is_422(api, created):
    response = api("POST", ASSIGN, data='{"unit": "\\ud800"}', content_type="application/json")
    assert error_of(response, 422)["details"][0]["location"] == "unit"


def test_assign_batch_over_the_limit_is_422(api, created):
    error = error_of(api("POST", ASSIGN, json={"units": [f"u{i}" for i in range(10_001)]}), 422)
    assert error["details"][0]["location"] == "units"


# ------------------------------------------------------------------------- observations
@pytest.mark.parametrize("item, location", [
    (observation(values={"z": 1.0}), "observations[1].values.z"),
    (observation(arm="c"), "observations[1].arm"),
    (observation(round=1), "observations[1].round"),
    (observation(round=-1), "observations[1].round"),
    (observation(round="0"), "observations[1].round"),
    (observation(values={}), "observations[1].values"),
    (observation(values={"x": "1"}), "observations[1].values.x"),
    (observation(values={"x": 1e200}), "observations[1].values.x"),
    (observation(values={"x": True}), "observations[1].values.x"),
    (observation(values={"x": None}), "observations[1].values.x"),
    (observation(values=[1.0]), "observations[1].values"),
    (observation(id=""), "observations[1].id"),
    (observation(id=7), "observations[1].id"),
    (observation(unit=None), "observations[1].unit"),
    (observation(extra=1), "observations[1].extra"),
    ({"unit": "u1", "round": 0, "values": {"x": 1.0}}, "observations[1].id"),
])
def test_invalid_observation_rejects_the_whole_batch(api, app, created, item, location):
    good = observation(id="good", unit="u2")
    error = error_of(api("POST", OBSERVATIONS, json={"observations": [good, item]}), 422)
    assert error["details"][0]["location"] == location, error
    assert error["message"].startswith(location)
    for model in (ObservationId, RoundStatistic, ArmRoundCount, RoundUnit):
        assert count_rows(app, model) == 0


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e309"])
def test_non_finite_values_are_422(api, app, created, literal):
    text = '{"observations": [{"id": "o1", "unit": "u1", "round": 0, "values": {"x": %s}}]}' % literal
    error = error_of(api("POST", OBSERVATIONS, data=text, content_type="application/json"), 422)
    assert error["details"][0]["location"] == "observations[0].values.x"
    assert "finite" in error["message"]
    assert count_rows(app, ObservationId) == 0


def test_arm_that_contradicts_the_sticky_assignment_is_422(api, app, created):
    assigned = api("POST", ASSIGN, json={"unit": "u1"}).get_json()["arm"]
    other = "b" if assigned == "a" else "a"
    error = error_of(api("POST", OBSERVATIONS, json={"observations": [observation(arm=other)]}), 422)
    assert error["details"][0]["location"] == "observations[0].arm"
    assert assigned in error["message"] and other in error["message"]
    assert api("POST", OBSERVATIONS, json={"observations": [observation(arm=assigned)]}).status_code == 202


def test_every_problem_of_a_batch_is_listed_in_body_order(api, app, created):
    assigned = api("POST", ASSIGN, json={"unit": "u1"}).get_json()["arm"]
    other = "b" if assigned == "a" else "a"
    batch = [
        observation(id="o0", round=7),
        observation(id="o1", values={"z": 1.0, "q": 2.0}),
        observation(id="o2"),
        observation(id="o3", unit="u1", arm=other),
        observation(id="o4", arm="c", round=9),
    ]
    error = error_of(api("POST", OBSERVATIONS, json={"observations": batch}), 422)
    assert [item["location"] for item in error["details"]] == [
        "observations[0].round", "observations[1].values.z", "observations[1].values.q",
        "observations[3].arm", "observations[4].round", "observations[4].arm"]
    assert error["message"].startswith("observations[0].round: Round 7 has not started")
    assert "(5 more problems in details)" in error["message"]
    assert count_rows(app, ObservationId) == 0


def test_a_batch_wrong_throughout_gets_the_first_hundred_problems(api, created):
    batch = [observation(id=f"o{i}", unit=f"u{i}", values={"z": 1.0}) for i in range(250)]
    error = error_of(api("POST", OBSERVATIONS, json={"observations": batch}), 422)
    assert len(error["details"]) == 100
    assert error["details"][99]["location"] == "observations[99].values.z"
    assert "(249 more problems; details lists the first 100)" in error["message"]


@pytest.mark.parametrize("body, location", [
    ({}, "observations"),
    ({"observations": []}, "observations"),
    ({"observations": {"id": "o1"}}, "observations"),
    ({"observations": [observation()], "more": 1}, "more"),
])
def test_invalid_observation_envelope_is_422(api, created, body, location):
    assert error_of(api("POST", OBSERVATIONS, json=body), 422)["details"][0]["location"] == location


def test_observation_batch_over_the_limit_is_422(api, created):
    batch = [observation(id=f"o{i}", unit=f"u{i}") for i in range(10_001)]
    error = error_of(api("POST", OBSERVATIONS, json={"observations": batch}), 422)
    assert error["details"][0]["location"] == "observations"


def test_stopped_experiment_refuses_observations_with_409(api, app, created):
    assert api("POST", "/api/v1/experiments/setup-a/stop").status_code == 200
    error = error_of(api("POST", OBSERVATIONS, json={"observations": [observation()]}), 409)
    assert "stopped" in error["message"]
    assert count_rows(app, ObservationId) == 0


# ------------------------------------------------------------------------- rounds and status
def test_closing_a_paused_experiment_is_409(api, created):
    assert api("POST", "/api/v1/experiments/setup-a/pause").status_code == 200
    assert "paused" in error_of(api("POST", "/api/v1/experiments/setup-a/rounds"), 409)["message"]


def test_closing_a_round_that_is_not_current_is_409(api, created):
    assert api("POST", "/api/v1/experiments/setup-a/rounds", json={"round": 0}).status_code == 200
    error = error_of(api("POST", "/api/v1/experiments/setup-a/rounds", json={"round": 0}), 409)
    assert "Round 0" in error["message"]


@pytest.mark.parametrize("body, location", [
    ({"round": "0"}, "round"), ({"round": -1}, "round"), ({"round": True}, "round"), ({"when": 1}, "body"),
    ([0], "body"),
])
def test_invalid_close_body_is_422(api, created, body, location):
    error = error_of(api("POST", "/api/v1/experiments/setup-a/rounds", json=body), 422)
    assert error["details"][0]["location"] == location


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_a_stopped_experiment_cannot_be_paused_or_resumed(api, created, action):
    assert api("POST", "/api/v1/experiments/setup-a/stop").status_code == 200
    error = error_of(api("POST", f"/api/v1/experiments/setup-a/{action}"), 409)
    assert "stopped" in error["message"]


def test_type_errors_and_unknown_names_are_reported_together_in_body_order(api, app, created):
    # The batch: a string where a number belongs and an unknown metric, in different items
    # and in one item; the 422 names every one of them (type errors used to hide the rest).
    batch = [
        observation(id="o0", values={"x": "60"}),
        observation(id="o1", values={"z": 1.0}),
        observation(id="o2", values={"x": "60", "z": 1.0}, arm="c"),
        observation(id="o3", round=9),
    ]
    error = error_of(api("POST", OBSERVATIONS, json={"observations": batch}), 422)
    assert [item["location"] for item in error["details"]] == [
        "observations[0].values.x", "observations[1].values.z", "observations[2].values.x",
        "observations[2].values.z", "observations[2].arm", "observations[3].round"]  # "arm" is last in o2
    assert error["details"][1]["message"] == "Unknown metric 'z'; the metrics are ['x', 'y']."
    assert error["details"][4]["message"] == "Unknown arm 'c'."
    assert error["details"][5]["message"] == "Round 9 has not started; the current round is 0."
    assert error["message"].startswith("observations[0].values.x: ") and "(5 more problems in details)" in error["message"]
    assert count_rows(app, ObservationId) == 0
    # The same unknown metric in a well-typed batch is worded the same way (the other check).
    alone = error_of(api("POST", OBSERVATIONS, json={"observations": [observation(values={"z": 1.0})]}), 422)
    assert alone["details"] == [error["details"][1] | {"location": "observations[0].values.z"}]


def test_one_more_problem_is_singular(api, created):
    error = error_of(api("POST", OBSERVATIONS, json={"observations": [
        observation(id="o0", values={"x": "60"}), observation(id="o1", values={"z": 1.0})]}), 422)
    assert error["message"].endswith("(1 more problem in details)"), error["message"]


# ------------------------------------------------------------------------- statistics batches
STATISTICS = "/api/v1/experiments/setup-a/statistics"


def cell(**overrides):
    item = {"round": 0, "arm": "a", "metric": "x", "count": 3, "sum": 6.0, "sum_of_squares": 14.0}
    item.update(overrides)
    return item


def statistics_rows(app) -> tuple[int, int, int]:
    from service.models import StatisticsBatch
    return count_rows(app, StatisticsBatch), count_rows(app, RoundStatistic), count_rows(app, ArmRoundCount)


@pytest.mark.parametrize("item, location", [
    (cell(count=0), "cells[1].count"),
    (cell(count=2.0), "cells[1].count"),
    (cell(count=True), "cells[1].count"),
    (cell(count=2**53 + 1), "cells[1].count"),
    (cell(sum="6"), "cells[1].sum"),
    (cell(sum_of_squares=-1.0), "cells[1].sum_of_squares"),
    (cell(sum=6.0, sum_of_squares=11.9), "cells[1]"),  # 6**2 / 3 = 12 > 11.9: no real values
    (cell(count=1, sum=-2.0, sum_of_squares=3.9), "cells[1]"),
    (cell(count=1, sum=1e101, sum_of_squares=1e202), "cells[1]"),  # outside the webhook's value range
    (cell(round=-1), "cells[1].round"),
    (cell(round=1), "cells[1].round"),  # not started
    (cell(arm="zz"), "cells[1].arm"),
    (cell(metric="zz"), "cells[1].metric"),
    (cell(metric="not a name"), "cells[1].metric"),
    (cell(extra=1), "cells[1].extra"),
    ({k: v for k, v in cell().items() if k != "sum"}, "cells[1].sum"),
    (cell(metric="y", round=0), None),  # valid: the control case
])
def test_invalid_statistics_cell_rejects_the_whole_batch(api, app, created, item, location):
    body = {"batch_id": "batch-1", "cells": [cell(), item], "units": [{"round": 0, "arm": "a", "units": 2}]}
    response = api("POST", STATISTICS, role="ingest", json=body)
    if location is None:
        assert response.status_code == 202, response.get_json()
        assert statistics_rows(app) == (1, 2, 1)
        return
    error = error_of(response, 422)
    assert error["code"] == "invalid_request"
    assert [detail["location"] for detail in error["details"]] == [location]
    assert error["message"].startswith(location + ": ") and error["message"].endswith(".")
    assert statistics_rows(app) == (0, 0, 0)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e309"])
def test_non_finite_statistics_are_422(api, app, created, literal):
    for field in ("sum", "sum_of_squares"):
        text = json.dumps({"batch_id": "b", "cells": [cell()]}).replace(f'"{field}": {cell()[field]}', f'"{field}": {literal}')
        error = error_of(api("POST", STATISTICS, role="ingest", data=text, content_type="application/json"), 422)
        assert error["details"][0]["location"] == f"cells[0].{field}"
    assert statistics_rows(app) == (0, 0, 0)


@pytest.mark.parametrize("body, location", [
    ({"cells": [cell()]}, "batch_id"),
    ({"batch_id": "", "cells": [cell()]}, "batch_id"),
    ({"batch_id": "x" * 257, "cells": [cell()]}, "batch_id"),
    ({"batch_id": "b", "cells": []}, "cells"),
    ({"batch_id": "b"}, "cells"),
    ({"batch_id": "b", "cells": [cell()], "units": [{"round": 0, "arm": "a", "units": -1}]}, "units[0].units"),
    ({"batch_id": "b", "cells": [cell()], "units": [{"round": 0, "arm": "q", "units": 1}]}, "units[0].arm"),
    ({"batch_id": "b", "cells": [cell()], "units": [{"round": 4, "arm": "a", "units": 1}]}, "units[0].round"),
    ({"batch_id": "b", "cells": [cell()], "segments": []}, "segments"),
])
def test_invalid_statistics_envelope_is_422(api, app, created, body, location):
    error = error_of(api("POST", STATISTICS, role="ingest", json=body), 422)
    assert [detail["location"] for detail in error["details"]] == [location]
    assert statistics_rows(app) == (0, 0, 0)


def test_a_second_entry_for_one_key_is_422(api, app, created):
    body = {"batch_id": "b", "cells": [cell(), cell(metric="y"), cell(count=4, sum_of_squares=20.0)],
            "units": [{"round": 0, "arm": "b", "units": 1}, {"round": 0, "arm": "b", "units": 2}]}
    error = error_of(api("POST", STATISTICS, role="ingest", json=body), 422)
    assert error["details"] == [
        {"location": "cells[2]", "message": "Duplicate round, arm and metric (first at cells[0]); a batch holds one "
                                            "cell per round, arm and metric."},
        {"location": "units[1]", "message": "Duplicate round and arm (first at units[0]); a batch holds one units "
                                            "entry per round and arm."},
    ]
    assert statistics_rows(app) == (0, 0, 0)


def test_every_problem_of_a_statistics_batch_is_listed_in_body_order(api, app, created):
    """Type errors (pydantic) and unknown names (the experiment) in one answer, in body order."""
    body = {"batch_id": "b", "cells": [cell(arm="q"), cell(count=0), cell(metric="z", sum_of_squares=1.0)],
            "units": [{"round": 9, "arm": "a", "units": 1}]}
    error = error_of(api("POST", STATISTICS, role="ingest", json=body), 422)
    assert [detail["location"] for detail in error["details"]] == [
        "cells[0].arm", "cells[1].count", "cells[2]", "cells[2].metric", "units[0].round"]
    assert error["message"].endswith("(4 more problems in details)")
    assert statistics_rows(app) == (0, 0, 0)


def test_statistics_need_the_ingest_role(api, app, created):
    body = {"batch_id": "b", "cells": [cell()]}
    assert error_of(api("POST", STATISTICS, role="read", json=body), 403)["code"] == "forbidden"
    assert error_of(api("POST", STATISTICS, role=None, json=body), 401)["code"] == "unauthorized"
    assert error_of(api("POST", "/api/v1/experiments/nope/statistics", role="ingest", json=body), 404)
    assert statistics_rows(app) == (0, 0, 0)


def test_stopped_experiment_refuses_statistics_with_409(api, app, created):
    assert api("POST", "/api/v1/experiments/setup-a/stop").status_code == 200
    error = error_of(api("POST", STATISTICS, role="ingest", json={"batch_id": "b", "cells": [cell()]}), 409)
    assert "stopped" in error["message"]
    assert statistics_rows(app) == (0, 0, 0)
