"""The OpenFeature Remote Evaluation Protocol endpoints (service/routes/ofrep.py): the arm /assign gives,
with the protocol's shapes, error codes, ETag and the same exposure log."""

from __future__ import annotations

import json

import jsonschema
import pytest

from service.auth import create_token
from service.db import get_db
from service.exposures import get_exposures

from .conftest import Api

ONE = "/ofrep/v1/evaluate/flags/{}"
BULK = "/ofrep/v1/evaluate/flags"
ARMS = [{"name": f"blend-{k}", "params": {"w_watch": k / 4, "label": f"b{k}"}} for k in range(5)]
#: Segmented experiments take hard guardrails only (docs/segments.md).
HARD = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]}


def evaluate(api, key: str, context, role: str | None = "ingest", **kwargs):
    return api("POST", ONE.format(key), role=role, json=None if context is None else {"context": context}, **kwargs)


def published(api, path: str, status: str):
    document = api("GET", "/api/v1/openapi.json", role=None).get_json()
    schema = document["paths"][path]["post"]["responses"][status]["content"]["application/json"]["schema"]
    return {**schema, "components": document["components"]}


def test_a_flag_is_the_arm_assign_gives_with_its_propensity(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a("feed", arms=ARMS)).status_code == 201
    units = [f"user-{i}" for i in range(300)] + ["déjà vu", "ユーザー", "😀" * 64]
    assigned = api("POST", "/api/v1/experiments/feed/assign", role="ingest", json={"units": units}).get_json()
    experiment = api("GET", "/api/v1/experiments/feed").get_json()
    schema = published(api, "/ofrep/v1/evaluate/flags/{key}", "200")
    for unit, expected in zip(units, assigned["assignments"]):
        response = evaluate(api, "feed", {"targetingKey": unit, "country": "fr", "segment": "ignored"})
        assert response.status_code == 200
        body = response.get_json()
        jsonschema.Draft202012Validator(schema).validate(body)
        assert body == {"key": "feed", "value": expected["params"], "reason": "SPLIT", "variant": expected["arm"],
                        "metadata": {"propensity": expected["probability"], "round": 0,
                                     "mixture_version": experiment["updated_at"]}}


def test_protocol_errors(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a("feed")).status_code == 201
    missing = evaluate(api, "feed", {"country": "fr"})
    assert missing.status_code == 400 and missing.get_json()["errorCode"] == "TARGETING_KEY_MISSING"
    assert missing.get_json()["key"] == "feed"
    assert evaluate(api, "feed", {"targetingKey": ""}).get_json()["errorCode"] == "TARGETING_KEY_MISSING"
    for bad in ({"targetingKey": 42}, {"targetingKey": "x" * 257}, {"targetingKey": "a\x00b"},
                {"targetingKey": "u", "segment": 7}):
        response = evaluate(api, "feed", bad)
        assert (response.status_code, response.get_json()["errorCode"]) == (400, "INVALID_CONTEXT"), bad
    for body in ({}, {"context": "u"}, [1]):
        response = api("POST", ONE.format("feed"), role="ingest", json=body)
        assert (response.status_code, response.get_json()["errorCode"]) == (400, "INVALID_CONTEXT")
    parse = api("POST", ONE.format("feed"), role="ingest", data=b"{not json", content_type="application/json")
    assert (parse.status_code, parse.get_json()["errorCode"]) == (400, "PARSE_ERROR")
    unknown = evaluate(api, "nope", {"targetingKey": "u"})
    assert unknown.status_code == 404
    assert unknown.get_json() == {"key": "nope", "errorCode": "FLAG_NOT_FOUND",
                                  "errorDetails": "There is no experiment named 'nope'."}
    jsonschema.Draft202012Validator(published(api, "/ofrep/v1/evaluate/flags/{key}", "404")).validate(unknown.get_json())
    jsonschema.Draft202012Validator(published(api, "/ofrep/v1/evaluate/flags/{key}", "400")).validate(missing.get_json())
    assert evaluate(api, "feed", {"targetingKey": "u"}, role=None).status_code == 401
    assert evaluate(api, "nope", {"targetingKey": "u"}, role=None).status_code == 401  # nothing leaks
    assert evaluate(api, "feed", {"targetingKey": "u"}, role="read").status_code == 403
    assert api("POST", BULK, role="read", json={"context": {"targetingKey": "u"}}).status_code == 403
    bulk = api("POST", BULK, role="ingest", json={"context": {}})
    assert bulk.status_code == 400 and bulk.get_json() == {
        "errorCode": "TARGETING_KEY_MISSING", "errorDetails": "The context has no targetingKey: give the unit to assign."}


def test_segmented_experiments_take_the_segment_from_the_context(api, setup_a):
    body = setup_a("by-platform", arms=ARMS, segments=["web", "app"], objective=HARD)
    assert api("POST", "/api/v1/experiments", json=body).status_code == 201
    for segment in ("web", "app"):
        expected = api("POST", "/api/v1/experiments/by-platform/assign", role="ingest",
                       json={"units": [f"u{i}" for i in range(50)], "segment": segment}).get_json()["assignments"]
        for i, answer in enumerate(expected):
            got = evaluate(api, "by-platform", {"targetingKey": f"u{i}", "segment": segment}).get_json()
            assert (got["variant"], got["metadata"]["propensity"], got["metadata"]["segment"]) == (
                answer["arm"], answer["probability"], segment)
    for context, words in (({"targetingKey": "u"}, "give the unit's segment"),
                           ({"targetingKey": "u", "segment": "tv"}, "Unknown segment 'tv'")):
        response = evaluate(api, "by-platform", context)
        assert response.status_code == 400
        assert response.get_json()["errorCode"] == "INVALID_CONTEXT" and words in response.get_json()["errorDetails"]


def test_bulk_evaluates_every_experiment_with_an_etag(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a("first", arms=ARMS)).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("second", seed=99)).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("segmented", segments=["web", "app"], objective=HARD)).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("gone")).status_code == 201
    assert api("POST", "/api/v1/experiments/gone/archive").status_code == 200
    context = {"context": {"targetingKey": "user-7"}}
    response = api("POST", BULK, role="ingest", json=context)
    assert response.status_code == 200
    body = response.get_json()
    jsonschema.Draft202012Validator(published(api, BULK, "200")).validate(body)
    assert [flag["key"] for flag in body["flags"]] == ["first", "second", "segmented"]
    for flag in body["flags"][:2]:
        expected = evaluate(api, flag["key"], {"targetingKey": "user-7"}).get_json()
        assert flag == expected
    assert body["flags"][2]["errorCode"] == "INVALID_CONTEXT"
    with_segment = api("POST", BULK, role="ingest", json={"context": {"targetingKey": "user-7", "segment": "web"}})
    assert [flag.get("variant") is not None for flag in with_segment.get_json()["flags"]] == [True, True, True]
    assert with_segment.get_json()["flags"][:2] == body["flags"][:2]  # unsegmented ones ignore the segment

    tag = response.headers["ETag"]
    again = api("POST", BULK, role="ingest", json=context, headers={"If-None-Match": tag})
    assert again.status_code == 304 and again.headers["ETag"] == tag and again.get_data() == b""
    other_unit = api("POST", BULK, role="ingest", json={"context": {"targetingKey": "user-8"}},
                     headers={"If-None-Match": tag})
    assert other_unit.status_code == 200 or other_unit.headers["ETag"] == tag
    assert api("POST", "/api/v1/experiments/first/rounds").status_code == 200  # a new round: new answers
    after = api("POST", BULK, role="ingest", json=context, headers={"If-None-Match": tag})
    assert after.status_code == 200 and after.headers["ETag"] != tag
    assert after.get_json()["flags"][0]["metadata"]["round"] == 1


def test_evaluations_are_logged_as_exposures_like_assign(app_factory, sqlite_url, tmp_path, setup_a):
    path = tmp_path / "exposures.jsonl"
    app = app_factory(sqlite_url, PASTO_EXPOSURE_LOG=str(path))
    with get_db(app).write() as session:
        tokens = {role: create_token(session, role, f"test-{role}") for role in ("ingest", "admin")}
    api = Api(app.test_client(), tokens)
    assert api("POST", "/api/v1/experiments", json=setup_a("feed", arms=ARMS)).status_code == 201
    units = [f"user-{i}" for i in range(200)]
    answers = [evaluate(api, "feed", {"targetingKey": unit}).get_json() for unit in units]
    bulk = api("POST", BULK, role="ingest", json={"context": {"targetingKey": "bulk-unit"}}).get_json()["flags"]
    refused = evaluate(api, "feed", {"country": "fr"})  # no assignment: no exposure
    assert refused.status_code == 400
    get_exposures(app).log.close()
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(r["unit"], r["arm"], r["round"], r["probability"], r["mixture_version"]) for r in records] == [
        (unit, a["variant"], a["metadata"]["round"], a["metadata"]["propensity"], a["metadata"]["mixture_version"])
        for unit, a in zip(units + ["bulk-unit"], answers + bulk)]


@pytest.mark.parametrize("body", [b"", b"null", b'{"context": null}', b'{"context": {"targetingKey": null}}'])
def test_empty_and_null_bodies_are_protocol_errors(api, setup_a, body):
    assert api("POST", "/api/v1/experiments", json=setup_a("feed")).status_code == 201
    response = api("POST", ONE.format("feed"), role="ingest", data=body, content_type="application/json")
    assert response.status_code == 400
    assert response.get_json()["errorCode"] in ("PARSE_ERROR", "INVALID_CONTEXT", "TARGETING_KEY_MISSING")


def test_each_backend_evaluates_as_it_assigns(backend_api, setup_a):
    api = backend_api
    assert api("POST", "/api/v1/experiments", json=setup_a("feed", arms=ARMS)).status_code == 201
    assert api("POST", "/api/v1/experiments/feed/rounds").status_code == 200  # round 1
    units = [f"user-{i}" for i in range(100)]
    assigned = api("POST", "/api/v1/experiments/feed/assign", role="ingest", json={"units": units}).get_json()
    for unit, expected in zip(units, assigned["assignments"]):
        got = evaluate(api, "feed", {"targetingKey": unit}).get_json()
        assert (got["variant"], got["metadata"]["propensity"], got["metadata"]["round"]) == (
            expected["arm"], expected["probability"], 1)
    bulk = api("POST", BULK, role="ingest", json={"context": {"targetingKey": "user-3"}}).get_json()
    assert bulk["flags"][0]["variant"] == assigned["assignments"][3]["arm"]
