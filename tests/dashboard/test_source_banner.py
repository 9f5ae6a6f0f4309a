"""The dashboard shows a failing metric source: a banner on the experiment page, a badge on the overview."""

from __future__ import annotations

import threading

import pytest
import requests
from werkzeug.serving import make_server

import migrations
from service import create_app
from service.db import get_db

pytestmark = pytest.mark.chromium

ADMIN = "source-banner-admin-token"


@pytest.fixture
def server(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    migrations.upgrade(database_url)
    app = create_app({"PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": ADMIN,
                      "PASTO_DASHBOARD_POLL_SECONDS": 0.5, "PASTO_ANONYMOUS_LOOPBACK_READ": True})
    http = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{http.server_port}"
    finally:
        http.shutdown()
        thread.join(timeout=10)
        http.server_close()
        get_db(app).engine.dispose()


def test_a_failing_source_is_a_banner_and_a_badge(server, browser, tmp_path):
    headers = {"Authorization": f"Bearer {ADMIN}"}
    missing = tmp_path / "no-such-folder"
    response = requests.post(f"{server}/api/v1/experiments", headers=headers, timeout=30, json={
        "name": "warehouse-fed",
        "arms": [{"name": "a", "params": {}}, {"name": "b", "params": {}}],
        "metrics": ["x"],
        "objective": {"primary": "x"},
        "round_seconds": 3600,
        "source": {"files": {"exposures": {"path": f"{missing}/exposures/*.parquet"},
                             "events": {"path": f"{missing}/events/*.parquet"}},
                   "mapping": {"exposures": {"table": "exposures", "unit": "unit", "arm": "arm", "round": "round"},
                               "events": {"table": "events", "unit": "unit", "timestamp": "ts",
                                          "metrics": {"x": "x"}}}},
    })
    assert response.status_code == 201, response.text
    # The admin's close queries the source, which fails: the round stays open, the error is stored.
    response = requests.post(f"{server}/api/v1/experiments/warehouse-fed/rounds", headers=headers, timeout=30, json={})
    assert response.status_code == 502, response.text
    message = requests.get(f"{server}/api/v1/experiments/warehouse-fed/diagnostics", headers=headers,
                           timeout=30).json()["source_error"]["message"]

    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    problems = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.goto(f"{server}/experiments/warehouse-fed")
    page.wait_for_selector('#experiment[data-rounds="1"]')
    banner = page.locator("#source-error")
    assert banner.is_visible()
    assert message in banner.inner_text() and "stays open" in banner.inner_text()
    assert banner.get_attribute("role") == "alert"

    page.goto(f"{server}/")
    badge = page.locator('tr[data-experiment="warehouse-fed"] td >> nth=1 >> .badge.bad')
    badge.wait_for()
    assert badge.inner_text() == "source failing"
    assert problems == []
    context.close()
