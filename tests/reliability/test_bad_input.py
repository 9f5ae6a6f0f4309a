"""Bad input never breaks the service: a fuzzed API answers only 2xx/4xx, every 4xx says what was
wrong, and a rejected batch writes nothing.

* ``test_fuzzed_requests_never_get_a_5xx``: schemathesis generates over 2,000 requests, valid and
  invalid (positive and negative data), for every operation of the service's own OpenAPI document and
  sends them to the real Flask app, with a token of the role each route needs, against a database
  holding a running experiment with closed rounds and observations. Each generated case is also sent
  to real experiments (path-parameter overrides) and some observation batches are pointed at real
  metrics and rounds, so requests reach validation and storage instead of stopping at a 404. It
  proves: no 5xx; every 4xx is the JSON error shape with a non-empty message; a rejected observation
  batch leaves the ingestion tables as they were; and the count of requests really sent (a generator
  that silently shrinks fails it).
* Explicit cases that ``tests/service/test_invalid.py`` does not already cover, each asserting the
  status, the location of the first problem and the words of the message that say what was wrong:
  non-finite and out-of-range numbers in every numeric field (raw JSON text: Python's json writes
  NaN), 413 under a small limit, under the default 16 MiB one and for a chunked body on a real server,
  wrong JSON types in every field, unknown arms and metrics, Unicode unit ids (accepted, sticky and
  stored verbatim on SQLite and PostgreSQL; lone surrogates refused), SQL-looking strings (refused
  by a pattern or stored as plain data, the tables intact).
* "Nothing half-written": after every rejected request of this module the row counts of
  observation_ids, round_statistics, arm_round_counts and round_units (and the experiments and
  rounds) are unchanged, on top of a non-empty baseline, including a batch that fails inside the
  database transaction after some of its rows were written.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections import Counter
from typing import Any

import pytest
import requests
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings

from service.auth import create_token
from service.config import DEFAULT_MAX_CONTENT_LENGTH
from service.db import get_db
from tests.service.conftest import backend_url, make_app, serve, setup_a_body  # noqa: F401 (fixtures used below)

ROLES = ("metrics", "read", "ingest", "admin")
INGESTION_TABLES = ("observation_ids", "round_statistics", "arm_round_counts", "round_units")

LIVE = "live"  # running; rounds 0 and 1 closed with observations; serving round 2
STOPPED = "stopped"  # stopped: ingestion answers 409
DOOMED = "doomed"  # the only experiment the fuzzed `stop` operation may stop, so LIVE keeps running
LIVE_ROUND = 2

EXPERIMENTS = "/api/v1/experiments"
ASSIGN = f"{EXPERIMENTS}/{LIVE}/assign"
OBSERVATIONS = f"{EXPERIMENTS}/{LIVE}/observations"
CLOSE = f"{EXPERIMENTS}/{LIVE}/rounds"

MINIMUM_FUZZED_REQUESTS = 2_000
SQL_STRINGS = ("'; DROP TABLE observation_ids; --", '" OR 1=1 --', "x'); DELETE FROM round_units WHERE ('1'='1")


def observation(**overrides: Any) -> dict[str, Any]:
    item = {"id": "o-1", "unit": "u-1", "round": LIVE_ROUND, "values": {"x": 1.0, "y": 2.0}}
    item.update(overrides)
    return item


class Service:
    """The real Flask app on a migrated database, a stored token per role, and what the tests read."""

    def __init__(self, database_url: str) -> None:
        self.app = make_app(database_url)
        self.client = self.app.test_client()
        with get_db(self.app).write() as session:
            self.tokens = {role: create_token(session, role, f"bad-input-{role}") for role in ROLES}

    def headers(self, role: str = "admin") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def __call__(self, method: str, path: str, role: str = "admin", **kwargs: Any):
        headers = {**self.headers(role), **kwargs.pop("headers", {})}
        return self.client.open(path, method=method, headers=headers, **kwargs)

    def raw(self, method: str, path: str, text: str | bytes, role: str = "admin"):
        """Send ``text`` as the JSON body byte for byte (NaN, lone surrogates and all)."""
        return self(method, path, role, data=text, content_type="application/json")

    def sql(self, statement: str, **parameters: Any) -> list[tuple]:
        with get_db(self.app).engine.connect() as connection:
            return [tuple(row) for row in connection.execute(sa.text(statement), parameters)]

    def counts(self) -> dict[str, int]:
        """Rows of the four ingestion tables."""
        return {table: self.sql(f"SELECT count(*) FROM {table}")[0][0] for table in INGESTION_TABLES}

    def state(self) -> dict[str, Any]:
        """Everything a rejected request must leave alone: ingestion rows, experiments, rounds."""
        return {**self.counts(),
                "experiments": self.sql("SELECT name, status, round_index, version FROM experiments ORDER BY id"),
                "rounds": self.sql("SELECT count(*) FROM rounds")[0][0]}

    def table_names(self) -> set[str]:
        return set(sa.inspect(get_db(self.app).engine).get_table_names())

    def close(self) -> None:
        get_db(self.app).engine.dispose()


def seed_experiments(service: Service) -> None:
    """LIVE with 40 observed units in each of rounds 0 and 1, both closed; STOPPED; DOOMED."""
    for name in (LIVE, STOPPED, DOOMED):
        assert service("POST", EXPERIMENTS, json=setup_a_body(name)).status_code == 201
    for round_index in range(LIVE_ROUND):
        units = [f"seed-{round_index}-{i}" for i in range(40)]
        assigned = service("POST", ASSIGN, "ingest", json={"units": units}).get_json()["assignments"]
        batch = [{"id": f"seed-{round_index}-{i}", "unit": item["unit"], "round": round_index, "arm": item["arm"],
                  "values": {"x": float(i % 5), "y": float(i % 3) - 0.5}} for i, item in enumerate(assigned)]
        assert service("POST", OBSERVATIONS, "ingest", json={"observations": batch}).status_code == 202
        assert service("POST", CLOSE, json={"round": round_index}).status_code == 200
    assert service("POST", f"{EXPERIMENTS}/{STOPPED}/stop").status_code == 200


@pytest.fixture
def service(tmp_path):
    """A fresh seeded service on SQLite (for tests that change it)."""
    instance = Service(f"sqlite:///{tmp_path / 'pasto.sqlite'}")
    seed_experiments(instance)
    yield instance
    instance.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One seeded service for the rejection tables: a rejected request changes nothing, so they may
    share it (and each of them checks exactly that)."""
    instance = Service(f"sqlite:///{tmp_path_factory.mktemp('shared') / 'pasto.sqlite'}")
    seed_experiments(instance)
    yield instance
    instance.close()


@pytest.fixture
def backend_service(backend_url):  # noqa: F811 (the fixture imported above)
    """A seeded service on SQLite and on PostgreSQL (``tests/service/conftest.py``'s ``backend_url``)."""
    instance = Service(backend_url)
    seed_experiments(instance)
    yield instance
    instance.close()


def error_of(response) -> dict[str, Any]:
    """The ``error`` object of a 4xx response, after checking the whole error shape."""
    assert 400 <= response.status_code < 500, (response.status_code, response.get_data(as_text=True)[:500])
    assert response.is_json, response.get_data(as_text=True)[:500]
    body = response.get_json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"code", "message", "details"}
    assert isinstance(error["code"], str) and error["code"]
    assert isinstance(error["message"], str) and error["message"].strip()
    return error


def rejected(response, status: int, location: str | None, *words: str) -> dict[str, Any]:
    """Check a ``status`` error whose first problem is at ``location`` and whose message has ``words``."""
    error = error_of(response)
    assert response.status_code == status, (response.status_code, error)
    if location is not None:
        assert error["details"][0]["location"] == location, error
        assert error["message"].startswith(f"{location}: "), error
    for word in words:
        assert word.lower() in error["message"].lower(), (word, error["message"])
    return error


def refuse_and_check_nothing_changed(service: Service, send, status: int, location: str | None,
                                     *words: str) -> dict[str, Any]:
    before = service.state()
    error = rejected(send(), status, location, *words)
    assert service.state() == before, "a rejected request changed the database"
    return error


# ====================================================================== non-finite and out-of-range numbers
LITERALS = ["NaN", "Infinity", "-Infinity", "1e309", "-1e309"]
_SETUP = json.dumps(setup_a_body("numbers", settle_seconds=0))
# (request, JSON text with {v} where the literal goes, location of the problem, word of the message).
# test_invalid covers a NaN/Infinity/1e309 metric value of a one-observation batch, NaN params and
# the guardrail threshold; these are every other numeric field.
NUMERIC_FIELDS = [
    ("POST", OBSERVATIONS, json.dumps({"observations": [observation(id="g1"), observation(id="g2", unit="u-2"),
                                                        observation(id="g3", unit="u-3")]})
     .replace('"y": 2.0}}]}', '"y": {v}}}]}'), "observations[2].values.y", "finite"),
    ("POST", OBSERVATIONS, json.dumps({"observations": [observation()]}).replace('"round": 2', '"round": {v}'),
     "observations[0].round", "integer"),
    ("POST", CLOSE, '{"round": {v}}', "round", "integer"),
    ("POST", EXPERIMENTS, _SETUP.replace('"round_seconds": 3600', '"round_seconds": {v}'), "round_seconds", "finite"),
    ("POST", EXPERIMENTS, _SETUP.replace('"settle_seconds": 0', '"settle_seconds": {v}'), "settle_seconds", "finite"),
    ("POST", EXPERIMENTS, _SETUP.replace('"seed": 7', '"seed": {v}'), "seed", "integer"),
    ("POST", EXPERIMENTS, _SETUP.replace('"penalty": 5.0', '"penalty": {v}'),
     "objective.guardrails[0].penalty", "finite"),
    ("POST", EXPERIMENTS, _SETUP.replace('"primary": "x"', '"primary": {"x": {v}}'),
     "objective.primary.weights.x", "finite"),
    ("POST", EXPERIMENTS, _SETUP.replace('"weight": 0.0', '"weight": [1, {"w": {v}}]'), "arms[1].params", "finite"),
    ("POST", ASSIGN, '{"units": ["u-1", {v}]}', "units[1]", "string"),
]


@pytest.mark.parametrize("literal", LITERALS)
@pytest.mark.parametrize("method, path, template, location, word", NUMERIC_FIELDS,
                         ids=[f"{path.rsplit('/', 1)[-1]}:{location}" for _, path, _, location, _ in NUMERIC_FIELDS])
def test_non_finite_numbers_are_refused_naming_the_field(shared, literal, method, path, template, location, word):
    text = template.replace("{v}", literal)
    assert literal in text  # the template really placed it
    refuse_and_check_nothing_changed(shared, lambda: shared.raw(method, path, text), 422, location, word)


OUT_OF_RANGE = [
    ("POST", OBSERVATIONS, {"observations": [observation(round=2**31)]}, "observations[0].round", "less than"),
    ("POST", OBSERVATIONS, {"observations": [observation(round=10**30)]}, "observations[0].round", "less than"),
    ("POST", OBSERVATIONS, {"observations": [observation(round=2.0)]}, "observations[0].round", "integer"),
    ("POST", OBSERVATIONS, {"observations": [observation(values={"x": -1e101})]}, "observations[0].values.x",
     "greater than"),
    ("POST", EXPERIMENTS, setup_a_body("big-seed", seed=2**63), "seed", "less than"),
    ("POST", EXPERIMENTS, setup_a_body("big-weight", objective={"primary": {"x": 1e101}}),
     "objective.primary.weights.x", "less than"),
    ("POST", CLOSE, {"round": 2**70}, None, "Round 1180591620717411303424"),
]


@pytest.mark.parametrize("method, path, body, location, word", OUT_OF_RANGE,
                         ids=[f"{location}={str(body)[-30:]}" for _, _, body, location, _ in OUT_OF_RANGE])
def test_out_of_range_numbers_are_refused_naming_the_field(shared, method, path, body, location, word):
    status = 409 if path == CLOSE else 422  # a round that does not exist yet is a state conflict
    refuse_and_check_nothing_changed(shared, lambda: shared(method, path, json=body), status, location, word)


# ====================================================================== oversized bodies
@pytest.mark.parametrize("path, body", [
    (OBSERVATIONS, {"observations": [observation(id=f"o-{i}", unit=f"u-{i}") for i in range(40)]}),
    (EXPERIMENTS, setup_a_body("many-arms", arms=[{"name": f"arm-{i}"} for i in range(100)])),
    (CLOSE, {"round": LIVE_ROUND, "padding": "x" * 4096}),  # closing must not happen on a body it refused
], ids=["observations", "experiment", "close-round"])
def test_body_over_a_small_limit_is_413_naming_the_limit(shared, monkeypatch, path, body):
    monkeypatch.setitem(shared.app.config, "MAX_CONTENT_LENGTH", 2048)
    assert len(json.dumps(body)) > 2048
    error = refuse_and_check_nothing_changed(shared, lambda: shared("POST", path, json=body), 413, None,
                                             "2,048 bytes", "MAX_CONTENT_LENGTH")
    assert error["code"] == "request_entity_too_large"
    assert error["details"] == {"max_content_length": 2048}


def test_realistic_backlog_over_the_default_16_mib_is_413(shared):
    """A client flushing a 160,000-observation backlog in one request (ids and units as UUID-like
    strings, two metrics) sends about 20 MiB: refused as a whole, nothing stored."""
    assert shared.app.config["MAX_CONTENT_LENGTH"] == DEFAULT_MAX_CONTENT_LENGTH == 16 * 1024 * 1024
    batch = [{"id": f"9f1c2d3e-{i:012d}-obs", "unit": f"user-5b7e-{i:012d}", "round": LIVE_ROUND,
              "values": {"x": 0.123456789 * (i % 97), "y": -0.5 + (i % 13) / 7}} for i in range(160_000)]
    text = json.dumps({"observations": batch})
    assert len(text) > DEFAULT_MAX_CONTENT_LENGTH
    error = refuse_and_check_nothing_changed(shared, lambda: shared.raw("POST", OBSERVATIONS, text), 413, None,
                                             "16,777,216 bytes")
    assert error["details"] == {"max_content_length": DEFAULT_MAX_CONTENT_LENGTH}


def test_chunked_bodies_on_a_real_server(service, serve):  # noqa: F811 (the fixture imported above)
    """Without Content-Length (chunked transfer), the limit still gives a 413, not "not valid JSON"
    about the truncated text, and ``{"round": N}`` is still honoured when closing a round."""
    base = serve(service.app)
    headers = {**service.headers(), "Content-Type": "application/json"}

    def chunked(payload: bytes):
        yield from (payload[start:start + 512] for start in range(0, len(payload), 512))

    service.app.config["MAX_CONTENT_LENGTH"] = 2048
    batch = json.dumps({"observations": [observation(id=f"c-{i}", unit=f"c-{i}") for i in range(40)]}).encode()
    before = service.state()
    response = requests.post(base + OBSERVATIONS, data=chunked(batch), headers=headers, timeout=30)
    assert response.status_code == 413, response.text
    assert "2,048 bytes" in response.json()["error"]["message"]
    assert service.state() == before

    response = requests.post(base + CLOSE, data=chunked(b'{"round": 999}'), headers=headers, timeout=30)
    assert response.status_code == 409, response.text
    assert "Round 999" in response.json()["error"]["message"]
    assert service.state() == before, "a chunked close of round 999 closed the current round"

    small = json.dumps({"observations": [observation(id="c-ok")]}).encode()
    response = requests.post(base + OBSERVATIONS, data=chunked(small), headers=headers, timeout=30)
    assert response.status_code == 202, response.text


# ====================================================================== wrong JSON types
def _creation(**change: Any) -> dict[str, Any]:
    return {**setup_a_body("typed"), **change}


def _guardrail(**change: Any) -> dict[str, Any]:
    return {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0, **change}]}


def _batch(**change: Any) -> dict[str, Any]:
    """A valid observation, then one with ``change``: the second is the one named."""
    return {"observations": [observation(id="good", unit="good"), observation(**{"id": "o-2", **change})]}


# (request path, body, location, word the message must contain). What test_invalid already has
# (string round_seconds, boolean round_seconds, a float seed, string/boolean/null metric values,
# a list of values, numeric id, null unit, integer metric name, list params) is not repeated.
WRONG_TYPES = [
    (EXPERIMENTS, _creation(name=123), "name", "string"),
    (EXPERIMENTS, _creation(arms={"a": {}, "b": {}}), "arms", "list"),
    (EXPERIMENTS, _creation(arms=["a", "b"]), "arms[0]", "dictionary"),
    (EXPERIMENTS, _creation(arms=[{"name": 1}, {"name": "b"}]), "arms[0].name", "string"),
    (EXPERIMENTS, _creation(arms=[{"name": "a", "params": "w=1"}, {"name": "b"}]), "arms[0].params", "dictionary"),
    (EXPERIMENTS, _creation(metrics="x"), "metrics", "list"),
    (EXPERIMENTS, _creation(metrics={"x": 1, "y": 2}), "metrics", "list"),
    (EXPERIMENTS, _creation(objective="x"), "objective", "dictionary"),
    (EXPERIMENTS, _creation(objective={"primary": ["x"]}), "objective.primary", "metric name or an object"),
    (EXPERIMENTS, _creation(objective={"primary": 1}), "objective.primary", "metric name or an object"),
    (EXPERIMENTS, _creation(objective={"primary": {"x": "1"}}), "objective.primary.weights.x", "number"),
    (EXPERIMENTS, _creation(objective={"primary": {"x": True}}), "objective.primary.weights.x", "number"),
    (EXPERIMENTS, _creation(objective={"primary": "x", "guardrails": {"metric": "y"}}), "objective.guardrails",
     "list"),
    (EXPERIMENTS, _creation(objective=_guardrail(threshold="0")), "objective.guardrails[0].threshold", "number"),
    (EXPERIMENTS, _creation(objective=_guardrail(penalty=True)), "objective.guardrails[0].penalty", "number"),
    (EXPERIMENTS, _creation(objective=_guardrail(metric=["y"])), "objective.guardrails[0].metric", "string"),
    (EXPERIMENTS, _creation(settle_seconds="0"), "settle_seconds", "number"),
    (EXPERIMENTS, _creation(round_seconds=[60]), "round_seconds", "number"),
    (EXPERIMENTS, _creation(round_seconds={"seconds": 60}), "round_seconds", "number"),
    (EXPERIMENTS, _creation(seed="7"), "seed", "integer"),
    (EXPERIMENTS, _creation(seed=True), "seed", "integer"),
    (EXPERIMENTS, _creation(algorithm="default"), "algorithm", "dictionary"),
    (EXPERIMENTS, _creation(algorithm={"preset": 1}), "algorithm.preset", "'paper' or 'default'"),
    (ASSIGN, {"unit": True}, "unit", "string"),
    (ASSIGN, {"unit": 1.5}, "unit", "string"),
    (ASSIGN, {"unit": {"id": "u-1"}}, "unit", "string"),
    (ASSIGN, {"unit": ["u-1"]}, "unit", "string"),
    (ASSIGN, {"units": {"u-1": 1}}, "units", "list"),
    (ASSIGN, {"units": [["u-1"]]}, "units[0]", "string"),
    (ASSIGN, {"units": ["u-1", True]}, "units[1]", "string"),
    (ASSIGN, {"units": ["u-1", None]}, "units[1]", "string"),
    (OBSERVATIONS, {"observations": "o-1"}, "observations", "list"),
    (OBSERVATIONS, {"observations": [observation(), ["o-2", "u-2", 2]]}, "observations[1]", "dictionary"),
    (OBSERVATIONS, _batch(round=True), "observations[1].round", "integer"),
    (OBSERVATIONS, _batch(round=False), "observations[1].round", "integer"),
    (OBSERVATIONS, _batch(round=[2]), "observations[1].round", "integer"),
    (OBSERVATIONS, _batch(round={"index": 2}), "observations[1].round", "integer"),
    (OBSERVATIONS, _batch(values={"x": [1.0]}), "observations[1].values.x", "number"),
    (OBSERVATIONS, _batch(values={"x": {"value": 1.0}}), "observations[1].values.x", "number"),
    (OBSERVATIONS, _batch(values="x=1"), "observations[1].values", "dictionary"),
    (OBSERVATIONS, _batch(arm=1), "observations[1].arm", "string"),
    (OBSERVATIONS, _batch(arm=["a"]), "observations[1].arm", "string"),
    (OBSERVATIONS, _batch(unit=["u-1"]), "observations[1].unit", "string"),
    (OBSERVATIONS, _batch(unit=True), "observations[1].unit", "string"),
    (OBSERVATIONS, _batch(id={"key": 1}), "observations[1].id", "string"),
    (OBSERVATIONS, _batch(id=True), "observations[1].id", "string"),
    (CLOSE, {"round": 2.0}, "round", "integer"),
    (CLOSE, {"round": [2]}, "round", "integer"),
    (CLOSE, {"round": {"index": 2}}, "round", "integer"),
    (CLOSE, {"round": None}, "round", "integer"),
]


@pytest.mark.parametrize("path, body, location, word", WRONG_TYPES,
                         ids=[f"{path.rsplit('/', 1)[-1]}:{location}:{i}" for i, (path, _, location, _)
                              in enumerate(WRONG_TYPES)])
def test_wrong_json_types_are_422_naming_the_field_and_the_type(shared, path, body, location, word):
    refuse_and_check_nothing_changed(shared, lambda: shared("POST", path, json=body), 422, location, word)


# ====================================================================== unknown arms and metrics
def _long_batch(bad: dict[str, Any], position: int = 700) -> dict[str, Any]:
    """``position`` valid observations of distinct units, then ``bad``."""
    good = [observation(id=f"long-{i}", unit=f"long-{i}") for i in range(position)]
    return {"observations": [*good, observation(id="bad", unit="bad-unit", **bad)]}


UNKNOWN = [
    (OBSERVATIONS, _long_batch({"values": {"x": 1.0, "z": 1.0}}), "observations[700].values.z",
     ("Unknown metric 'z'", "['x', 'y']")),
    (OBSERVATIONS, _long_batch({"values": {"X": 1.0}}, 3), "observations[3].values.X", ("Unknown metric 'X'",)),
    (OBSERVATIONS, _long_batch({"arm": "c"}), "observations[700].arm", ("Unknown arm 'c'",)),
    (OBSERVATIONS, _long_batch({"arm": "A"}, 3), "observations[3].arm", ("Unknown arm 'A'",)),
    (OBSERVATIONS, _long_batch({"values": {"y y": 1.0}}, 2), "observations[2].values.y y.[key]", ("pattern",)),
    (EXPERIMENTS, _creation(objective={"primary": {"x": 1.0, "z": 2.0}}), "objective", ("'z'",)),
]


@pytest.mark.parametrize("path, body, location, words", UNKNOWN, ids=[location for _, _, location, _ in UNKNOWN])
def test_unknown_arms_and_metrics_are_named(shared, path, body, location, words):
    refuse_and_check_nothing_changed(shared, lambda: shared("POST", path, json=body), 422, location, *words)


# ====================================================================== Unicode identifiers
VALID_UNICODE_UNITS = [
    "ユーザー-1",
    "🦊🚀-42",  # outside the BMP: surrogate pairs in escaped JSON
    "مستخدم-٧",
    "e\u0301-combining",  # not normalised: a different unit from "é-combining"
    "é-combining",
    "zero\u200dwidth\u2028separator",
    "tab\tand\nnewline",
    "𝔘" * 256,  # the longest unit id, four UTF-8 bytes per character
]


def test_unicode_unit_ids_are_accepted_sticky_and_stored_verbatim(backend_service):
    service = backend_service
    arms = ("a", "b")
    for position, unit in enumerate(VALID_UNICODE_UNITS):
        first = service("POST", ASSIGN, "ingest", json={"unit": unit})
        assert first.status_code == 200, (unit, first.get_json())
        arm = first.get_json()["arm"]
        assert first.get_json()["unit"] == unit
        # Sticky: again, in a batch, and with the body sent as raw UTF-8 instead of \u escapes.
        assert service("POST", ASSIGN, "ingest", json={"unit": unit}).get_json()["arm"] == arm
        batch = service("POST", ASSIGN, "ingest", json={"units": ["other", unit]}).get_json()["assignments"]
        assert batch[1] == {**first.get_json(), "unit": unit}
        raw = json.dumps({"unit": unit}, ensure_ascii=False).encode("utf-8")
        assert service.raw("POST", ASSIGN, raw, "ingest").get_json()["arm"] == arm

        other = arms[1 - arms.index(arm)]
        error = refuse_and_check_nothing_changed(
            service, lambda: service("POST", OBSERVATIONS, "ingest", json={"observations": [
                observation(id=f"wrong-{position}", unit=unit, arm=other)]}),
            422, "observations[0].arm")
        assert repr(unit) in error["message"] and repr(arm) in error["message"]

        accepted = service("POST", OBSERVATIONS, "ingest", json={"observations": [
            observation(id=unit, unit=unit), observation(id=f"second-{position}", unit=unit, arm=arm)]})
        assert accepted.get_json() == {"accepted": 2, "duplicates": 0}, (unit, accepted.get_json())

    stored_units = {row[0] for row in service.sql("SELECT unit FROM round_units WHERE round_index = :r",
                                                  r=LIVE_ROUND)}
    stored_ids = {row[0] for row in service.sql("SELECT client_id FROM observation_ids WHERE round_index = :r",
                                                r=LIVE_ROUND)}
    assert stored_units == set(VALID_UNICODE_UNITS)
    assert set(VALID_UNICODE_UNITS) <= stored_ids


# Raw JSON texts with an unpaired UTF-16 surrogate (legal JSON escapes, not Unicode text), where it is.
LONE_SURROGATES = [
    (OBSERVATIONS, '{"observations": [{"id": "\\ud800", "unit": "u", "round": 2, "values": {"x": 1}}]}',
     "observations[0].id"),
    (OBSERVATIONS, '{"observations": [{"id": "o", "unit": "\\udc00\\ud800", "round": 2, "values": {"x": 1}}]}',
     "observations[0].unit"),
    (OBSERVATIONS, '{"observations": [{"id": "o", "unit": "u", "round": 2, "arm": "\\ud83d", "values": {"x": 1}}]}',
     "observations[0].arm"),
    (ASSIGN, '{"unit": "user-\\udfff-1"}', "unit"),
    (ASSIGN, '{"units": ["u", "\\ud83e"]}', "units[1]"),
    (EXPERIMENTS, _SETUP.replace('"name": "a"', '"name": "a\\ud800"'), "arms[0].name"),
    (EXPERIMENTS, _SETUP.replace('"weight": 1.0', '"\\udbff": 1.0'), "arms[0].params"),
    (EXPERIMENTS, _SETUP.replace('"weight": 1.0', '"weight": ["\\udfff"]'), "arms[0].params"),
]


@pytest.mark.parametrize("path, text, location", LONE_SURROGATES, ids=[location for _, _, location in LONE_SURROGATES])
def test_lone_surrogates_are_refused(shared, path, text, location):
    refuse_and_check_nothing_changed(shared, lambda: shared.raw("POST", path, text), 422, location, "unicode")


def test_invalid_utf8_is_400_naming_the_byte(shared):
    error = refuse_and_check_nothing_changed(shared, lambda: shared.raw("POST", ASSIGN, b'{"unit": "\xff"}'), 400,
                                             None, "not valid JSON", "0xff")
    assert error["code"] == "invalid_json"


# ====================================================================== SQL-looking strings
def test_sql_looking_strings_are_refused_or_stored_as_plain_data(backend_service):
    service = backend_service
    tables = service.table_names()
    for text in SQL_STRINGS:
        # Experiment and metric names have a pattern: refused, naming the field.
        refuse_and_check_nothing_changed(service, lambda: service("POST", EXPERIMENTS, json={
            **setup_a_body("x"), "name": text}), 422, "name", "pattern")
        refuse_and_check_nothing_changed(service, lambda: service("POST", EXPERIMENTS, json=setup_a_body(
            "sql-metrics", metrics=[text, "y"])), 422, "metrics[0]", "pattern")
        refuse_and_check_nothing_changed(service, lambda: service("POST", OBSERVATIONS, json={"observations": [
            observation(values={text: 1.0})]}), 422, f"observations[0].values.{text}.[key]", "pattern")
        # ... and as a path segment it is just a name nobody has.
        quoted = urllib.parse.quote(text, safe="")
        for method, suffix in (("GET", ""), ("POST", "/observations"), ("POST", "/stop")):
            response = service(method, f"{EXPERIMENTS}/{quoted}{suffix}", json={"observations": [observation()]})
            assert text in rejected(response, 404, None, "no experiment named")["message"]
        # An unknown arm is named as given.
        error = refuse_and_check_nothing_changed(service, lambda: service("POST", OBSERVATIONS, json={
            "observations": [observation(arm=text)]}), 422, "observations[0].arm", "Unknown arm")
        assert repr(text) in error["message"]

    # Arm names, unit ids and observation ids are free text: stored and answered verbatim.
    created = service("POST", EXPERIMENTS, json=setup_a_body(
        "sql-arms", arms=[{"name": SQL_STRINGS[0]}, {"name": SQL_STRINGS[1]}]))
    assert created.status_code == 201, created.get_json()
    assert [arm["name"] for arm in created.get_json()["arms"]] == list(SQL_STRINGS[:2])
    batch = []
    for text in SQL_STRINGS:
        arm = service("POST", f"{EXPERIMENTS}/sql-arms/assign", json={"unit": text}).get_json()["arm"]
        assert arm in SQL_STRINGS[:2]
        batch.append({"id": text, "unit": text, "round": 0, "arm": arm, "values": {"x": 1.0}})
    path = f"{EXPERIMENTS}/sql-arms/observations"
    assert service("POST", path, json={"observations": batch}).get_json() == {"accepted": 3, "duplicates": 0}
    assert service("POST", path, json={"observations": batch}).get_json() == {"accepted": 0, "duplicates": 3}

    experiment_id = service.sql("SELECT id FROM experiments WHERE name = 'sql-arms'")[0][0]
    assert {row[0] for row in service.sql("SELECT client_id FROM observation_ids WHERE experiment_id = :e",
                                          e=experiment_id)} == set(SQL_STRINGS)
    assert {row[0] for row in service.sql("SELECT unit FROM round_units WHERE experiment_id = :e",
                                          e=experiment_id)} == set(SQL_STRINGS)
    assert {row[0] for row in service.sql("SELECT name FROM arms WHERE experiment_id = :e",
                                          e=experiment_id)} == set(SQL_STRINGS[:2])
    # The tables are intact: all there, and the seeded data and tokens untouched.
    assert service.table_names() == tables
    assert service.sql("SELECT count(*) FROM tokens")[0][0] == len(ROLES)
    live_id = service.sql("SELECT id FROM experiments WHERE name = :n", n=LIVE)[0][0]
    assert service.sql("SELECT count(*) FROM observation_ids WHERE experiment_id = :e", e=live_id)[0][0] == 80
    assert service.sql("SELECT count(*) FROM round_units WHERE experiment_id = :e", e=live_id)[0][0] == 80


# ====================================================================== nothing half-written
def _sticky_arm(service: Service, unit: str) -> str:
    return service("POST", ASSIGN, "ingest", json={"unit": unit}).get_json()["arm"]


def _contradicting_batch(service: Service) -> dict[str, Any]:
    """Five good observations, then one whose arm contradicts its unit's sticky assignment."""
    arm = _sticky_arm(service, "sticky-unit")
    other = "b" if arm == "a" else "a"
    good = [observation(id=f"ok-{i}", unit=f"ok-{i}") for i in range(5)]
    return {"observations": [*good, observation(id="contradiction", unit="sticky-unit", arm=other)]}


# (name, request builder, status, location of the problem). Each builds a batch whose good part would
# be stored if validation and storage were not one all-or-nothing step.
REJECTED_BATCHES = [
    ("2000 then an unknown metric", lambda s: ("POST", OBSERVATIONS, {"json": {"observations": [
        *(observation(id=f"big-{i}", unit=f"big-{i}") for i in range(2000)), observation(values={"q": 1.0})]}}),
     422, "observations[2000].values.q"),
    ("every round, then a round that has not started", lambda s: ("POST", OBSERVATIONS, {"json": {"observations": [
        *(observation(id=f"r-{i}", unit=f"r-{i}", round=i % 3) for i in range(30)), observation(round=3)]}}),
     422, "observations[30].round"),
    ("duplicate ids, then a wrong type", lambda s: ("POST", OBSERVATIONS, {"json": {"observations": [
        observation(id="dup"), observation(id="dup"), observation(id="seed-0-1", round=0), observation(unit=7)]}}),
     422, "observations[3].unit"),
    ("a sticky-arm contradiction after five good ones", lambda s: ("POST", OBSERVATIONS,
                                                                    {"json": _contradicting_batch(s)}),
     422, "observations[5].arm"),
    ("a stopped experiment", lambda s: ("POST", f"{EXPERIMENTS}/{STOPPED}/observations",
                                        {"json": {"observations": [observation()]}}), 409, None),
    ("10,001 observations", lambda s: ("POST", OBSERVATIONS, {"json": {"observations": [
        observation(id=f"n-{i}", unit=f"n-{i}") for i in range(10_001)]}}), 422, "observations"),
    ("truncated JSON", lambda s: ("POST", OBSERVATIONS, {
        "data": json.dumps({"observations": [observation()]})[:-3], "content_type": "application/json"}), 400, None),
    ("a form instead of JSON", lambda s: ("POST", OBSERVATIONS, {"data": {"id": "o"}}), 415, None),
]


@pytest.mark.parametrize("build, status, location", [case[1:] for case in REJECTED_BATCHES],
                         ids=[case[0] for case in REJECTED_BATCHES])
def test_a_rejected_batch_writes_nothing(shared, build, status, location):
    method, path, kwargs = build(shared)
    assert shared.counts()["observation_ids"] >= 80  # a non-empty baseline: additions would show
    refuse_and_check_nothing_changed(shared, lambda: shared(method, path, "ingest", **kwargs), status, location)


FAILING_UNIT = "fail-inside-the-transaction"
_TRIGGERS = {
    "sqlite": [f"CREATE TRIGGER fail_inside BEFORE INSERT ON round_units WHEN NEW.unit = '{FAILING_UNIT}' "
               "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"],
    "postgresql": [
        "CREATE FUNCTION fail_inside() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF NEW.unit = '{FAILING_UNIT}' THEN RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER fail_inside BEFORE INSERT ON round_units FOR EACH ROW EXECUTE FUNCTION fail_inside()",
    ],
}


def test_a_failure_inside_the_transaction_rolls_the_whole_batch_back(backend_service, caplog):
    """A database error after observation_ids and round_statistics rows of the batch were written
    (a trigger refuses one round_units row) leaves no row behind; once the fault is gone, the same
    batch is accepted in full, so no id was silently kept as a "duplicate"."""
    service = backend_service
    engine = get_db(service.app).engine
    with engine.begin() as connection:
        for statement in _TRIGGERS[engine.dialect.name]:
            connection.exec_driver_sql(statement)
    # round_units rows are written sorted by (round, unit), after the ids and statistics of the whole
    # batch: the ten round-0 units go in before the failing one, so the failure is truly half-way.
    batch = {"observations": [*(observation(id=f"t-{i}", unit=f"unit-{i}") for i in range(50)),
                              observation(id="t-fail", unit=FAILING_UNIT),
                              *(observation(id=f"t-{i}", unit=f"a-unit-{i}", round=0) for i in range(50, 60))]}
    before = service.state()
    response = service("POST", OBSERVATIONS, "ingest", json=batch)
    assert response.status_code == 500 and response.get_json()["error"]["code"] == "internal_error"
    assert "injected failure" in caplog.text  # it failed where the trigger is, inside the ingestion
    assert service.state() == before, "a batch that failed half-way left rows behind"

    with engine.begin() as connection:
        connection.exec_driver_sql("DROP TRIGGER fail_inside" if engine.dialect.name == "sqlite"
                                   else "DROP TRIGGER fail_inside ON round_units")
    assert service("POST", OBSERVATIONS, "ingest", json=batch).get_json() == {"accepted": 61, "duplicates": 0}
    assert service.counts()["observation_ids"] == before["observation_ids"] + 61


# ====================================================================== fuzzing with schemathesis
def _shape_problem(response, path: str = "") -> str | None:
    """Why a 4xx response is not the documented error shape, or None when it is. The OpenFeature routes'
    400 and 404 have the protocol's shape instead (``{key, errorCode, errorDetails}``, service/ofrep.py),
    except a 404 for a key no experiment can have (service/params.py, before the route runs)."""
    if not response.is_json:
        return f"not JSON ({response.content_type})"
    body = response.get_json(silent=True)
    ofrep_shaped = isinstance(body, dict) and "error" not in body
    if path.startswith("/ofrep/") and response.status_code in (400, 404) and ofrep_shaped:
        if not isinstance(body, dict) or set(body) - {"key"} != {"errorCode", "errorDetails"}:
            return f"not the OFREP error shape {{key, errorCode, errorDetails}}: {str(body)[:200]}"
        if not isinstance(body["errorDetails"], str) or not body["errorDetails"].strip():
            return f"empty errorDetails: {body}"
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"error"} or set(error) != {"code", "message", "details"}:
        return f"not {{'error': {{code, message, details}}}}: {str(body)[:200]}"
    if not isinstance(error["message"], str) or not error["message"].strip():
        return f"empty message: {error}"
    if not isinstance(error["code"], str) or not error["code"]:
        return f"empty code: {error}"
    return None


def _steer_observations(body: Any, metrics: list[str], round_index: int) -> Any:
    """Point generated observations at real metrics and rounds, keeping their generated ids and units,
    so some batches pass validation and reach the database with whatever strings hypothesis made up."""
    if not isinstance(body, dict) or not isinstance(body.get("observations"), list):
        return body
    steered = []
    for position, item in enumerate(body["observations"]):
        if isinstance(item, dict):
            # The live experiment is unsegmented: a generated segment would only make the batch a 422.
            item = {key: value for key, value in item.items() if key not in ("arm", "segment")}
            values = item.get("values")
            numbers = [value for value in values.values() if _is_number(value)] if isinstance(values, dict) else []
            item["values"] = {metric: numbers[i] if i < len(numbers) else float(position)
                              for i, metric in enumerate(metrics)}
            if isinstance(item.get("round"), int) and not isinstance(item.get("round"), bool):
                item["round"] = item["round"] % (round_index + 1)
        steered.append(item)
    return {**body, "observations": steered}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 1e100


def _required_role(app, method: str, path: str) -> str:
    """The role the route's view demands (``require_role``), admin for public routes."""
    endpoint, _ = app.url_map.bind("localhost").match(path.replace("{name}", LIVE), method=method)
    return getattr(app.view_functions[endpoint], "required_role", "admin")


# How many cases hypothesis generates per operation, for valid (positive) and invalid (negative) data.
# Generating a body is what costs (up to ~0.2 s a case for observation batches on a busy machine),
# so the cheap operations get more cases and every case is sent to each target of `_targets`.
EXAMPLES = {
    ("GET", "/api/v1/experiments"): (130, 0),
    ("POST", "/api/v1/experiments"): (30, 25),
    ("GET", "/api/v1/experiments/{name}"): (100, 10),
    ("POST", "/api/v1/experiments/{name}/assign"): (100, 25),
    ("POST", "/api/v1/experiments/{name}/observations"): (40, 20),
    ("GET", "/api/v1/experiments/{name}/rounds"): (80, 15),
    ("POST", "/api/v1/experiments/{name}/rounds"): (50, 20),
    ("GET", "/api/v1/experiments/{name}/diagnostics"): (25, 5),
    ("POST", "/api/v1/experiments/{name}/pause"): (60, 8),
    ("POST", "/api/v1/experiments/{name}/resume"): (60, 8),
    ("POST", "/api/v1/experiments/{name}/stop"): (60, 8),
}
PARAMETERLESS_EXAMPLES = 10  # /healthz, /metrics, the document: a handful of distinct requests at most


def _targets(path: str) -> list[tuple[str | None, bool]]:
    """Where one generated case is sent: (experiment name or None for the generated one, steer)."""
    if "{name}" not in path:
        return [(None, False)]
    if path.endswith("/stop"):
        return [(DOOMED, False), (None, False)]  # never LIVE: later operations need it running
    if path.endswith("/observations"):
        return [(LIVE, False), (LIVE, True), (STOPPED, False), (None, False)]
    return [(LIVE, False), (STOPPED, False), (None, False)]


@pytest.fixture
def schema_strategies_built_once(monkeypatch):
    """hypothesis-jsonschema builds each object property's value strategy from its schema again at
    every draw (canonicalising and merging the schema each time), about a tenth of the fuzz test's
    CPU. Within this test the same (schema, alphabet, formats) always builds the same strategy, so it
    is built once and reused: the strategies drawn from are the ones hypothesis-jsonschema makes."""
    from hypothesis_jsonschema import _from_schema
    from hypothesis_jsonschema._encode import encode_canonical_json

    build = getattr(_from_schema, "__from_schema")
    built: dict[tuple[str, bool, str | None, int], tuple[Any, Any]] = {}

    def build_once(schema, *, alphabet, custom_formats):
        # hypothesis-jsonschema's public ``from_schema`` (which schemathesis calls at every negative draw)
        # makes a new alphabet each time, always from the same two arguments: those are the key, not its id.
        key = (encode_canonical_json(schema), alphabet.allow_x00, alphabet.codec, id(custom_formats))
        if key not in built:
            # The formats are kept with the strategy: their id stays theirs.
            built[key] = (build(schema, alphabet=alphabet, custom_formats=custom_formats), custom_formats)
        return built[key][0]

    monkeypatch.setattr(_from_schema, "__from_schema", build_once)


def test_fuzzed_requests_never_get_a_5xx(service, schema_strategies_built_once):
    import schemathesis
    from schemathesis import DataGenerationMethod

    schemathesis.experimental.OPEN_API_3_1.enable()
    document = service.client.get("/api/v1/openapi.json").get_json()
    schema = schemathesis.from_dict(document, app=service.app, validate_schema=True)
    operations = [result.ok() for result in schema.get_all_operations()]
    live_metrics = service("GET", f"{EXPERIMENTS}/{LIVE}").get_json()["metrics"]

    sent: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    problems: list[str] = []
    started = time.perf_counter()

    def check(label: str, case, headers: dict[str, str], ingestion: bool) -> None:
        before = service.counts() if ingestion else None
        request = case.as_transport_kwargs(headers=headers)
        response = service.client.open(**request)
        sent[label] += 1
        statuses[response.status_code] += 1
        where = (f"{case.method} {request['path']} query={request.get('query_string')} "
                 f"body={str(case.body)[:300]!r} -> {response.status_code}")
        if response.status_code >= 500:
            problems.append(f"{where}: {response.get_data(as_text=True)[:300]}")
        elif response.status_code >= 400:
            shape = _shape_problem(response, case.path)
            if shape is not None:
                problems.append(f"{where}: {shape}")
            if before is not None and service.counts() != before:
                problems.append(f"{where}: rejected batch changed {before} to {service.counts()}")

    for operation in operations:
        method, path = operation.method.upper(), operation.path
        headers = service.headers(_required_role(service.app, method, path))
        positive, negative = EXAMPLES.get((method, path), (PARAMETERLESS_EXAMPLES, 0))
        targets = _targets(path)
        ingestion = path.endswith("/observations")

        for kind, examples in ((DataGenerationMethod.positive, positive), (DataGenerationMethod.negative, negative)):
            if examples == 0:
                continue
            label = f"{method} {path} {kind.name}"

            @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            @given(case=operation.as_strategy(data_generation_method=kind))
            def send(case):
                generated_name = (case.path_parameters or {}).get("name")
                generated_body = case.body
                for name, steer in targets:
                    if name is not None:
                        case.path_parameters = {**case.path_parameters, "name": name}
                    elif generated_name is not None:
                        case.path_parameters = {**case.path_parameters, "name": generated_name}
                    case.body = generated_body
                    if steer:
                        current = service("GET", f"{EXPERIMENTS}/{LIVE}").get_json()["round"]["index"]
                        case.body = _steer_observations(generated_body, live_metrics, current)
                    check(label, case, headers, ingestion)

            send()
        # A fuzzed pause leaves LIVE paused; later operations should still meet a running experiment.
        if service("GET", f"{EXPERIMENTS}/{LIVE}").get_json()["status"] == "paused":
            assert service("POST", f"{EXPERIMENTS}/{LIVE}/resume").status_code == 200

    total = sum(sent.values())
    elapsed = time.perf_counter() - started
    print(f"\nschemathesis: {total} requests in {elapsed:.1f} s; statuses {dict(sorted(statuses.items()))}")
    for label, count in sorted(sent.items()):
        print(f"  {count:5d}  {label}")
    assert not problems, f"{len(problems)} bad responses of {total}:\n" + "\n".join(problems[:25])
    assert total >= MINIMUM_FUZZED_REQUESTS, f"only {total} requests were generated: {dict(sent)}"
    # The overrides and steering must have worked: requests reached real experiments and stored data.
    assert statuses[200] + statuses[201] + statuses[202] >= total // 4, dict(statuses)
    assert service.counts()["observation_ids"] > 100, "hardly any fuzzed observation batch was stored"
    assert service.table_names() >= set(INGESTION_TABLES)
