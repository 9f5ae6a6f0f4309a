"""service.routes.assignment.FastAssign: an ordinary single-unit assign answered below Flask's
dispatch gives what Flask's path gives (status, headers, bytes, counters), and every other request
is Flask's answer, counted once."""

from __future__ import annotations

import io
import json
import sys

import pytest

from service import auth
from service.db import get_db
from service.monitoring import PROCESS_REGISTRY
from service.routes.assignment import FastAssign
from service.store import auth_failures
from tests.service.conftest import setup_a_body

ASSIGN = "/api/v1/experiments/{}/assign"
SEGMENTED = {"names": ["s1", "s2"], "shares": [0.5, 0.5]}


def environ(path: str, body: bytes | str, token: str | None, content_type: str = "application/json",
            query: str = "", method: str = "POST") -> dict:
    data = body.encode() if isinstance(body, str) else body
    env = {"REQUEST_METHOD": method, "PATH_INFO": path, "SCRIPT_NAME": "", "QUERY_STRING": query,
           "SERVER_NAME": "localhost", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
           "REMOTE_ADDR": "127.0.0.9", "wsgi.url_scheme": "http", "wsgi.input": io.BytesIO(data),
           "CONTENT_LENGTH": str(len(data)), "CONTENT_TYPE": content_type, "wsgi.errors": sys.stderr,
           "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False, "wsgi.version": (1, 0)}
    if token is not None:
        env["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return env


def call(wsgi, env: dict) -> tuple[str, list, bytes]:
    answer = []
    body = b"".join(wsgi(env, lambda status, headers, exc_info=None: answer.append((status, headers))))
    return answer[0][0], answer[0][1], body


def counted(name: str, **labels) -> float:
    return PROCESS_REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def served(app, api, tokens, monkeypatch):
    """An unsegmented and a segmented experiment, each served once through Flask (their snapshots
    cached, the ingest token looked up), and the middleware."""
    # A looked-up token is known for TOKEN_CACHE_SECONDS (1 s); on a loaded machine a test's thirty
    # requests outlast it, and a request just after the expiry rightly goes to Flask. These tests are
    # about what the fast path answers, so the lookup holds for the whole test.
    monkeypatch.setattr(auth, "TOKEN_CACHE_SECONDS", 3600.0)
    hard = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]}
    for body in (setup_a_body("plain"), setup_a_body("segmented", segments=SEGMENTED, objective=hard)):
        assert api("POST", "/api/v1/experiments", json=body).status_code == 201
    middleware = app.wsgi_app
    assert isinstance(middleware, FastAssign)
    assert middleware.hooks is not None, "the service's own hooks are the ones the fast path stands in for"
    for name, payload in (("plain", {"unit": "warm"}), ("segmented", {"unit": "warm", "segment": "s1"})):
        status, _, _ = call(middleware.flask, environ(ASSIGN.format(name), json.dumps(payload), tokens["ingest"]))
        assert status == "200 OK"
    return middleware


def test_an_ordinary_assign_or_batch_is_answered_below_flask_with_flasks_bytes_headers_and_counters(served, tokens,
                                                                                          monkeypatch):
    route = {"route": "/api/v1/experiments/<name>/assign", "method": "POST"}
    for index in range(30):
        payload = {"unit": f"user-{index}"} if index % 3 else {"units": [f"user-{index}-{j}" for j in range(index + 1)]}
        env = environ(ASSIGN.format("plain"), json.dumps(payload), tokens["ingest"])
        before = [counted("pasto_http_requests_total", status="200", **route),
                  counted("pasto_http_request_duration_seconds_count", **route),
                  sum(counted("pasto_assignments_total", experiment="plain", arm=arm) for arm in "ab")]
        flask = call(served.flask, dict(env, **{"wsgi.input": io.BytesIO(env["wsgi.input"].getvalue())}))
        middle = [counted("pasto_http_requests_total", status="200", **route),
                  counted("pasto_http_request_duration_seconds_count", **route),
                  sum(counted("pasto_assignments_total", experiment="plain", arm=arm) for arm in "ab")]
        with monkeypatch.context() as patched:  # Flask must not answer this one
            patched.setattr(served, "flask", lambda *_: pytest.fail("fell back to Flask"))
            fast = call(served, env)
        after = [counted("pasto_http_requests_total", status="200", **route),
                 counted("pasto_http_request_duration_seconds_count", **route),
                 sum(counted("pasto_assignments_total", experiment="plain", arm=arm) for arm in "ab")]
        assert fast == flask
        units = 1 if "unit" in payload else len(payload["units"])
        assert [m - b for m, b in zip(middle, before)] == [1, 1, units]
        assert [a - m for a, m in zip(after, middle)] == [1, 1, units]
    assert dict(fast[1])["X-Content-Type-Options"] == "nosniff"
    assert json.loads(fast[2])["unit"] == "user-29"
    assert len(json.loads(call(served, environ(ASSIGN.format("plain"), json.dumps({"units": ["a", "b"]}),
                                               tokens["ingest"]))[2])["assignments"]) == 2


@pytest.mark.parametrize("case", [
    "query string", "batch with a segment", "unit and units", "segment given", "segmented experiment", "unknown experiment",
    "name out of the pattern", "no token", "unknown token", "read token", "text body", "invalid json",
    "repeated key", "not an object", "unit missing", "unit too long", "no content length", "GET",
])
def test_every_other_request_gets_flasks_answer_counted_once(served, tokens, case, monkeypatch):
    body, token, kwargs, name = json.dumps({"unit": "u-1"}), tokens["ingest"], {}, "plain"
    if case == "query string":
        kwargs["query"] = "x=1"
    elif case == "batch with a segment":
        body = json.dumps({"units": ["u-1", "u-2"], "segment": "s1"})
    elif case == "unit and units":
        body = json.dumps({"unit": "u-0", "units": ["u-1", "u-2"]})
    elif case == "segment given":
        body = json.dumps({"unit": "u-1", "segment": "s1"})
    elif case == "segmented experiment":
        name = "segmented"
    elif case == "unknown experiment":
        name = "nope"
    elif case == "name out of the pattern":
        name = "Plain"
    elif case == "no token":
        token = None
    elif case == "unknown token":
        token = "not-a-token"
    elif case == "read token":
        token = tokens["read"]
    elif case == "text body":
        kwargs["content_type"] = "text/plain"
    elif case == "invalid json":
        body = '{"unit": '
    elif case == "repeated key":
        body = '{"unit": "a", "unit": "b"}'
    elif case == "not an object":
        body = '["u-1"]'
    elif case == "unit missing":
        body = "{}"
    elif case == "unit too long":
        body = json.dumps({"unit": "u" * 10_000})
    elif case == "GET":
        kwargs["method"] = "GET"
    env = environ(ASSIGN.format(name), body, token, **kwargs)
    if case == "no content length":
        del env["CONTENT_LENGTH"]
    requests_before = sum(sample.value for metric in PROCESS_REGISTRY.collect()
                          if metric.name == "pasto_http_requests" for sample in metric.samples
                          if sample.name.endswith("_total"))
    original = served.flask
    flask = call(original, dict(env, **{"wsgi.input": io.BytesIO(env["wsgi.input"].getvalue())}))
    handed = []
    monkeypatch.setattr(served, "flask", lambda *args: handed.append(args[0]) or original(*args))
    fast = call(served, env)
    assert len(handed) == 1, "Flask answered it"
    requests_after = sum(sample.value for metric in PROCESS_REGISTRY.collect()
                         if metric.name == "pasto_http_requests" for sample in metric.samples
                         if sample.name.endswith("_total"))
    assert fast[0] == flask[0] and fast[2] == flask[2], (case, fast, flask)
    assert dict(fast[1]) == dict(flask[1])
    assert requests_after - requests_before == 2, "each answer counted once"


def test_a_bad_token_is_counted_once_against_its_address(app, served):
    for attempt in range(3):
        status, _, _ = call(served, environ(ASSIGN.format("plain"), json.dumps({"unit": "u"}), "guess-1"))
        assert status.startswith("401")
    with get_db(app).read() as session:
        assert auth_failures(session, "127.0.0.9").failures == 3


def test_the_token_cache_expiring_sends_the_request_through_flask_which_looks_it_up_again(served, tokens,
                                                                                      monkeypatch):
    from service import auth

    env = environ(ASSIGN.format("plain"), json.dumps({"unit": "u-7"}), tokens["ingest"])
    monkeypatch.setattr(auth, "TOKEN_CACHE_SECONDS", 0.0)
    authenticator = served.app.extensions[auth._EXTENSION]
    authenticator._cache.clear()
    original = served.flask
    handed = []
    monkeypatch.setattr(served, "flask", lambda *args: handed.append(args[0]) or original(*args))
    status, _, body = call(served, env)
    assert len(handed) == 1, "Flask answered it"
    assert status == "200 OK" and json.loads(body)["unit"] == "u-7"
    assert authenticator.known_role(tokens["ingest"]) is None  # looked up, and at 0 s not kept


def test_a_request_hook_added_after_the_app_was_made_sends_assign_through_flask(sqlite_url, monkeypatch):
    from service.auth import create_token
    from tests.service.conftest import Api, make_app

    application = make_app(sqlite_url)
    seen = []
    application.before_request(lambda: seen.append(1))  # before the first request, as Flask requires
    with get_db(application).write() as session:
        tokens = {role: create_token(session, role, f"test-{role}") for role in ("ingest", "admin")}
    api = Api(application.test_client(), tokens)
    assert api("POST", "/api/v1/experiments", json=setup_a_body("plain")).status_code == 201
    middleware = application.wsgi_app
    env = environ(ASSIGN.format("plain"), json.dumps({"unit": "u-8"}), tokens["ingest"])
    assert call(middleware, dict(env, **{"wsgi.input": io.BytesIO(env["wsgi.input"].getvalue())}))[0] == "200 OK"
    original = middleware.flask
    handed = []
    monkeypatch.setattr(middleware, "flask", lambda *args: handed.append(args[0]) or original(*args))
    seen.clear()
    status, _, _ = call(middleware, env)
    assert status == "200 OK" and len(handed) == 1 and seen == [1]
    # Made over an app that already has a hook it does not stand in for, it never answers itself.
    assert FastAssign(application, original).hooks is None
    get_db(application).engine.dispose()
