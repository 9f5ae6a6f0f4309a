"""``parse_json`` (pydantic's JSON parser on the raw body, the ingestion fast path) accepts exactly
what ``parse(model, decode_json(body))`` accepts, with the same values, and fails with the same error,
for bodies without a repeated key; that is what ``parse(model, json.loads(body))`` does too
(``decode_json`` only adds the repeated-key check of the other routes)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from service.errors import ApiError
from service.schemas import ObservationBatch, decode_json, parse, parse_json

texts = st.text(max_size=6) | st.sampled_from(["", "a" * 257, "\x00", "é", "u-1", "\ud800"])
numbers = (st.floats(allow_nan=True, allow_infinity=True) | st.integers(-2**70, 2**70)
           | st.sampled_from([1e100, -1e100, 1.0000001e100]))
scalars = st.none() | st.booleans() | numbers | texts


def mostly(valid, invalid):
    """``valid`` nine times in ten, so that whole documents are often valid (the fast path's case)."""
    return st.integers(0, 9).flatmap(lambda k: invalid if k == 0 else valid)


identifiers = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=8)
metric_values = st.dictionaries(st.sampled_from(["x", "watch_time"]),
                                st.floats(-1e100, 1e100) | st.integers(-2**40, 2**40), min_size=1, max_size=2)
observations = st.fixed_dictionaries(
    {"id": mostly(identifiers, texts | scalars), "unit": mostly(identifiers, texts | scalars),
     "round": mostly(st.integers(0, 2**31 - 1), st.integers(-2, 2**40) | scalars),
     "values": mostly(metric_values, st.dictionaries(texts, numbers | scalars, max_size=3) | scalars)},
    optional={"arm": mostly(st.none() | identifiers, scalars), "extra": scalars},
)
bodies = mostly(st.fixed_dictionaries({"observations": st.lists(observations, min_size=1, max_size=3)}),
                st.fixed_dictionaries({"observations": st.lists(observations, max_size=3) | scalars})
                | st.lists(scalars, max_size=2) | scalars)


def _outcome(function, body: bytes):
    try:
        return "ok", function(ObservationBatch, body).model_dump()
    except ApiError as error:
        return "error", (error.status, error.code, error.message, error.details)


def _two_step(model, body: bytes):
    return parse(model, decode_json(body))


def _plain_json(model, body: bytes):
    return parse(model, json.loads(body))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_parse_json_agrees_with_the_two_step_path(document):
    body = json.dumps(document).encode()  # a dict has no repeated key
    outcome = _outcome(parse_json, body)
    assert outcome == _outcome(_two_step, body) == _outcome(_plain_json, body)
    event(outcome[0])  # hypothesis statistics: how many of the documents were valid


@pytest.mark.parametrize("body", [
    b'{"observations": [{"id": "a", "unit": "u", "round": 0, "values": {"x": NaN}}]}',
    b'{"observations": [{"id": "a", "unit": "u", "round": 0, "values": {"x": 1e309}}]}',
    b'{"observations": [{"id": "a\\ud800", "unit": "u", "round": 0, "values": {"x": 1}}]}',
    b'{"observations": [{"id": "a", "unit": "u", "round": 1.0, "values": {"x": 1}}]}',
    b'{"observations": [{"id": "a", "unit": "u", "round": 0, "values": {"x": 1}}]} trailing',
    b'{"observations": [', b'\xff\xfe', b'', b'[]', b'"text"',
])
def test_parse_json_agrees_on_edge_cases(body):
    assert _outcome(parse_json, body) == _outcome(_two_step, body)


def test_parse_json_keeps_the_last_value_of_a_repeated_key_where_the_other_routes_refuse_it():
    body = b'{"observations": [{"id": "a", "id": "b", "unit": "u", "round": 0, "values": {"x": 1}}]}'
    assert _outcome(parse_json, body) == _outcome(_plain_json, body)
    assert parse_json(ObservationBatch, body).observations[0].id == "b"
    with pytest.raises(ApiError) as refused:
        decode_json(body)
    assert refused.value.code == "duplicate_key"
