"""A live server on 127.0.0.1 with a seeded experiment of 32 closed rounds, and headless Chromium.

The experiment is seeded only through the HTTP API (create, batch assign, observe the assigned arm's
noisy metrics, close the round), as a client would, so the pages show what the service produces.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
from werkzeug.serving import make_server

from service import create_app
from service.auth import create_token
from service.db import get_db
from tests.migrated import upgrade_to_head

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
ADMIN_TOKEN = "dashboard-test-admin-token"
ROUNDS = 32
UNITS_PER_ROUND = 150
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "dashboard"

ARMS = [
    {"name": "control", "params": {"temperature": 1.0, "diversity": 0.0}},
    *({"name": f"t{temperature:.1f}-d{diversity}", "params": {"temperature": temperature, "diversity": diversity}}
      for temperature, diversity in [(0.6, 1), (0.6, 2), (0.8, 1), (0.8, 2), (1.2, 1), (1.2, 2), (1.5, 0)]),
]
METRICS = ["clicks", "dwell", "diversity"]
# True means, metric x arm: the best arm for clicks breaks the dwell guardrail, so mixing pays.
TRUE_MEANS = np.array([
    [1.00, 1.30, 1.45, 1.20, 1.25, 0.90, 0.95, 1.60],
    [0.60, 0.55, 0.35, 0.62, 0.50, 0.70, 0.66, 0.20],
    [0.50, 0.55, 0.70, 0.52, 0.65, 0.48, 0.60, 0.30],
])
NOISE = 0.5


@dataclass(frozen=True)
class LiveServer:
    base_url: str
    app: object
    tokens: dict[str, str]
    experiment: str

    def api(self, method: str, path: str, role: str = "admin", **kwargs) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.tokens[role]}"}
        response = requests.request(method, f"{self.base_url}/api/v1{path}", headers=headers, timeout=30, **kwargs)
        assert response.status_code < 400, f"{method} {path}: {response.status_code} {response.text}"
        return response


def _play_round(server: LiveServer, name: str, round_position: int, rng: np.random.Generator,
               units: int = UNITS_PER_ROUND) -> None:
    """One round of traffic: assign units, observe each one's arm, close the round."""
    unit_ids = [f"r{round_position}-u{i}" for i in range(units)]
    assignments = server.api("POST", f"/experiments/{name}/assign", role="ingest",
                             json={"units": unit_ids}).json()["assignments"]
    arm_positions = {arm["name"]: position for position, arm in enumerate(ARMS)}
    observations = []
    for assignment in assignments:
        arm = arm_positions[assignment["arm"]]
        values = TRUE_MEANS[:, arm] + NOISE * rng.standard_normal(len(METRICS))
        observations.append({"id": f"obs-{assignment['unit']}", "unit": assignment["unit"],
                             "round": assignment["round"], "arm": assignment["arm"],
                             "values": dict(zip(METRICS, values.tolist()))})
    # Hold back a few observations and send them after the close: they are late for that round.
    late = observations[-5:] if round_position % 4 == 3 else []
    server.api("POST", f"/experiments/{name}/observations", role="ingest",
               json={"observations": observations[: len(observations) - len(late)]})
    server.api("POST", f"/experiments/{name}/rounds")
    if late:
        server.api("POST", f"/experiments/{name}/observations", role="ingest", json={"observations": late})


def _create_experiments(server: LiveServer) -> None:
    server.api("POST", "/experiments", json={
        "name": server.experiment,
        "arms": ARMS,
        "metrics": METRICS,
        "objective": {"primary": "clicks", "guardrails": [
            {"metric": "dwell", "threshold": 0.5, "penalty": 5.0},
            {"metric": "diversity", "threshold": -0.05, "penalty": 5.0, "relative_to": "control"},
        ]},
        "round_seconds": 3600,
        "seed": 11,
    })
    rng = np.random.default_rng(20261122)
    for round_position in range(ROUNDS):
        _play_round(server, server.experiment, round_position, rng)
    # A second, small experiment so the overview lists more than one row and more than one status.
    server.api("POST", "/experiments", json={
        "name": "search-boost",
        "arms": [{"name": "off", "params": {"boost": 0}}, {"name": "on", "params": {"boost": 1}}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "round_seconds": 3600,
        "seed": 3,
    })
    server.api("POST", "/experiments/search-boost/pause")


@contextlib.contextmanager
def served_app(folder: Path, token_tag: str, experiment: str, **config: object) -> Iterator[LiveServer]:
    """A pasto app on a new migrated SQLite database in ``folder``, served by a threaded werkzeug server
    on a free loopback port, with read, ingest and admin tokens; stopped and its engine disposed on exit."""
    database_url = f"sqlite:///{folder / 'pasto.sqlite'}"
    upgrade_to_head(database_url)
    app = create_app({"PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": ADMIN_TOKEN,
                      "PASTO_DASHBOARD_POLL_SECONDS": 0.5, **config})
    with get_db(app).write() as session:
        tokens = {role: create_token(session, role, f"{token_tag}-{role}") for role in ("read", "ingest", "admin")}
    http = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield LiveServer(f"http://127.0.0.1:{http.server_port}", app, tokens, experiment)
    finally:
        http.shutdown()
        thread.join(timeout=10)
        http.server_close()
        get_db(app).engine.dispose()


@pytest.fixture(scope="module")
def live_server(tmp_path_factory) -> Iterator[LiveServer]:
    with served_app(tmp_path_factory.mktemp("dashboard"), "dashboard", "homepage-ranking") as server:
        _create_experiments(server)
        yield server


@pytest.fixture
def play_round(live_server) -> Callable[[str], None]:
    """``play_round(name)``: one more round of traffic on the live server, closed."""
    rng = np.random.default_rng(5)
    played = itertools.count(10_000)
    return lambda name: _play_round(live_server, name, next(played), rng)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium is not installed at {CHROMIUM} (Debian package `chromium`).")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture(scope="session")
def screenshot_dir() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
