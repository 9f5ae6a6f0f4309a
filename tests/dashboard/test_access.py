"""Who may read what the dashboard shows: a token, or anonymous read from loopback when enabled."""

from __future__ import annotations

import json
import re

import pytest

import migrations
from service import create_app
from service.config import load_config
from service.db import get_db

ADMIN = {"Authorization": "Bearer admin-token"}
EXPERIMENT = {
    "name": "pages",
    "arms": [{"name": "a", "params": {}}, {"name": "b", "params": {}}],
    "metrics": ["x"],
    "objective": {"primary": "x", "guardrails": []},
    "round_seconds": 60,
}


@pytest.fixture
def app(tmp_path):
    url = f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    migrations.upgrade(url)
    application = create_app({"PASTO_DATABASE_URL": url, "PASTO_ADMIN_TOKEN": "admin-token"})
    assert application.test_client().post("/api/v1/experiments", headers=ADMIN, json=EXPERIMENT).status_code == 201
    yield application
    get_db(application).engine.dispose()


def client_from(app, address: str):
    client = app.test_client()
    client.environ_base["REMOTE_ADDR"] = address
    return client


def page_config(response) -> dict:
    match = re.search(r'<script id="page-config" type="application/json">(.*?)</script>', response.get_data(as_text=True))
    return json.loads(match.group(1))


def test_reading_needs_a_token_unless_anonymous_loopback_read_is_enabled(app):
    loopback = client_from(app, "127.0.0.1")
    assert loopback.get("/api/v1/experiments").status_code == 401
    assert page_config(loopback.get("/"))["anonymousRead"] is False

    app.config["PASTO_ANONYMOUS_LOOPBACK_READ"] = True
    for address in ("127.0.0.1", "::1"):
        client = client_from(app, address)
        assert client.get("/api/v1/experiments").status_code == 200
        assert client.get("/api/v1/experiments/pages/diagnostics").status_code == 200
        assert page_config(client.get("/"))["anonymousRead"] is True
    # Only reading: ingestion and administration still need their tokens.
    assert loopback.post("/api/v1/experiments/pages/assign", json={"unit": "u"}).status_code == 401
    assert loopback.post("/api/v1/experiments/pages/pause").status_code == 401
    # A token that is sent is still checked.
    assert loopback.get("/api/v1/experiments", headers={"Authorization": "Bearer wrong"}).status_code == 401
    remote = client_from(app, "192.0.2.10")
    assert remote.get("/api/v1/experiments").status_code == 401
    assert page_config(remote.get("/"))["anonymousRead"] is False


def test_pages_render_without_a_token_and_do_not_tell_which_experiments_exist(app):
    client = client_from(app, "192.0.2.10")
    overview = client.get("/")
    assert overview.status_code == 200 and overview.mimetype == "text/html"
    config = page_config(overview)
    assert config["apiBase"] == "/api/v1"
    assert config["experimentPage"].replace("__name__", "pages") == "/experiments/pages"
    page = client.get("/experiments/pages")
    assert page.status_code == 200
    assert 'data-name="pages"' in page.get_data(as_text=True)
    # Without a token, a missing experiment's page is the existing one's with the other name.
    missing = client.get("/experiments/nothing-here")
    assert missing.status_code == 200
    assert missing.get_data(as_text=True).replace("nothing-here", "pages") == page.get_data(as_text=True)
    # Everything the pages load is served by this server: no network beyond it is needed.
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', overview.get_data(as_text=True)):
        assert client.get(asset).status_code == 200, asset
    assert "://" not in re.sub(r'https?://www\.w3\.org[^"]*', "", page.get_data(as_text=True))


@pytest.mark.parametrize("text, expected", [("1", True), ("true", True), ("on", True), ("0", False), ("no", False)])
def test_the_flag_is_read_from_the_environment(monkeypatch, tmp_path, text, expected):
    monkeypatch.setenv("PASTO_ANONYMOUS_LOOPBACK_READ", text)
    assert load_config(str(tmp_path))["PASTO_ANONYMOUS_LOOPBACK_READ"] is expected


def test_a_malformed_flag_is_refused_with_a_sentence(monkeypatch, tmp_path):
    monkeypatch.setenv("PASTO_ANONYMOUS_LOOPBACK_READ", "maybe")
    with pytest.raises(ValueError, match="PASTO_ANONYMOUS_LOOPBACK_READ must be"):
        load_config(str(tmp_path))


def test_html_pages_send_a_content_security_policy_and_refuse_framing(app):
    client = client_from(app, "192.0.2.10")
    for path in ("/", "/experiments/pages", "/experiments/nothing-here"):
        response = client.get(path)
        assert response.mimetype == "text/html"
        policy = dict(directive.strip().split(" ", 1) for directive in response.headers["Content-Security-Policy"].split(";"))
        assert policy["default-src"] == "'none'"
        assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'"
        assert policy["frame-ancestors"] == "'none'"
        assert response.headers["X-Frame-Options"] == "DENY"
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        # The only <script> without a src is the JSON data block, which browsers never execute.
        inline = re.findall(r"<script(?![^>]*\bsrc=)([^>]*)>", response.get_data(as_text=True))
        assert inline == [' id="page-config" type="application/json"'], inline
        assert " style=" not in response.get_data(as_text=True)
    api = client.get("/api/v1/experiments")
    assert api.headers["X-Content-Type-Options"] == "nosniff" and "Content-Security-Policy" not in api.headers
