"""End to end over real HTTP: setup-A traffic through the API reaches the paper's optimum.

Setup A (paper section 6.1): two arms with metric means x = [2, 0] and y = [-2, 2], guardrail
y >= 0 with penalty 5, Gaussian noise of variance 5 on every metric. The best mixture is
p* = [0.5125, 0.4875]; the best single arm scores 0.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import requests

from service.db import get_db
from service.scheduler import start_scheduler

TRUE_MEANS = {"a": (2.0, -2.0), "b": (0.0, 2.0)}
P_STAR = np.array([0.5125, 0.4875])
NOISE_STD = math.sqrt(5.0)
NAME = "setup-a"


class Traffic:
    """A population of users: assign a batch, observe each user's metrics under the assigned arm."""

    def __init__(self, base_url: str, token: str, seed: int, population: int = 5000) -> None:
        self.base = f"{base_url}/api/v1/experiments/{NAME}"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.rng = np.random.default_rng(seed)
        self.population = [f"user-{i}" for i in range(population)]
        self.sent = 0
        self.batches = 0

    def send(self, units_per_round: int) -> int:
        """One round of traffic; returns the round the units were assigned in."""
        units = list(self.rng.choice(self.population, size=units_per_round, replace=False))
        response = self.session.post(f"{self.base}/assign", json={"units": units}, timeout=30)
        response.raise_for_status()
        assignments = response.json()["assignments"]
        noise = self.rng.normal(0.0, NOISE_STD, size=(len(assignments), 2))
        observations = []
        for item, (noise_x, noise_y) in zip(assignments, noise):
            mean_x, mean_y = TRUE_MEANS[item["arm"]]
            observations.append({
                "id": f"{self.batches}:{item['unit']}", "unit": item["unit"], "round": item["round"],
                "arm": item["arm"], "values": {"x": mean_x + noise_x, "y": mean_y + noise_y},
            })
        response = self.session.post(f"{self.base}/observations", json={"observations": observations}, timeout=30)
        assert response.status_code == 202, response.text
        assert response.json() == {"accepted": len(observations), "duplicates": 0}
        self.sent += len(observations)
        self.batches += 1
        return assignments[0]["round"]

    def experiment(self) -> dict:
        response = self.session.get(self.base, timeout=30)
        response.raise_for_status()
        return response.json()


def create_setup_a(base_url: str, token: str, round_seconds: float) -> None:
    body = {
        "name": NAME,
        "arms": [{"name": "a", "params": {"ranker": "watch-time"}}, {"name": "b", "params": {"ranker": "likes"}}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "round_seconds": round_seconds,
        "algorithm": {"preset": "default"},
        "seed": 2024,
    }
    response = requests.post(f"{base_url}/api/v1/experiments", json=body,
                             headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 201, response.text


@pytest.mark.slow
def test_manual_rounds_reach_the_optimum(app, serve, admin_token):
    base_url = serve(app)
    create_setup_a(base_url, admin_token, round_seconds=3600)
    traffic = Traffic(base_url, admin_token, seed=1)
    for expected_round in range(100):
        assert traffic.send(units_per_round=200) == expected_round
        response = traffic.session.post(f"{traffic.base}/rounds", json={"round": expected_round}, timeout=30)
        assert response.status_code == 200, response.text
    experiment = traffic.experiment()
    assert experiment["round"]["index"] == 100
    deployed = np.array(experiment["deployed"])
    assert np.abs(deployed - P_STAR).max() < 0.05, deployed

    rounds = traffic.session.get(f"{traffic.base}/rounds", timeout=30).json()["rounds"]
    assert len(rounds) == 101
    assert sum(sum(entry["counts"]) for entry in rounds) == traffic.sent
    diagnostics = traffic.session.get(f"{traffic.base}/diagnostics", timeout=30).json()
    assert diagnostics["best_single"]["value"] < diagnostics["best_mixture"]["value"]
    assert np.abs(np.array(diagnostics["best_mixture"]["probabilities"]) - P_STAR).max() < 0.05
    assert diagnostics["srm"]["ok"] is True


@pytest.mark.slow
def test_scheduled_one_second_rounds_reach_the_optimum(sqlite_url, serve, admin_token, app_factory):
    app = app_factory(sqlite_url, PASTO_SCHEDULER_INTERVAL=0.2)
    scheduler = start_scheduler(app)
    try:
        base_url = serve(app)
        create_setup_a(base_url, admin_token, round_seconds=1)
        traffic = Traffic(base_url, admin_token, seed=2)
        last_round = -1
        # Hang guard, not a tolerance: 20 one-second rounds take ~21 s; 90 s lets a loaded machine run the rounds
        # 4x slower.
        deadline = time.monotonic() + 90
        while last_round < 20:
            assert time.monotonic() < deadline, f"the scheduler stopped advancing rounds at {last_round}"
            served_round = traffic.send(units_per_round=1000)
            assert served_round >= last_round
            if served_round == last_round:
                time.sleep(0.1)
            last_round = served_round
        experiment = traffic.experiment()
        assert experiment["applied_rounds"] >= 20
        deployed = np.array(experiment["deployed"])
        assert np.abs(deployed - P_STAR).max() < 0.05, deployed
        health = traffic.session.get(f"{base_url}/healthz", timeout=30).json()
        assert health["scheduler"]["alive"] is True
    finally:
        scheduler.shutdown(wait=True)
        get_db(app).engine.dispose()


def test_restart_mid_experiment_loses_nothing(backend_url, app_factory, admin_token):
    import threading

    from werkzeug.serving import make_server

    def run(application):
        server = make_server("127.0.0.1", 0, application, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        return server, thread, f"http://127.0.0.1:{server.server_port}"

    first_app = app_factory(backend_url)
    server, thread, base_url = run(first_app)
    try:
        create_setup_a(base_url, admin_token, round_seconds=3600)
        traffic = Traffic(base_url, admin_token, seed=3)
        for _ in range(12):
            traffic.send(units_per_round=100)
            assert traffic.session.post(f"{traffic.base}/rounds", timeout=30).status_code == 200
        traffic.send(units_per_round=100)  # the open round has data too
        before = traffic.experiment()
        rounds_before = traffic.session.get(f"{traffic.base}/rounds", timeout=30).json()
        token = traffic.session.post(f"{traffic.base}/assign", json={"unit": "sticky-user"}, timeout=30).json()
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()
        get_db(first_app).engine.dispose()

    second_app = app_factory(backend_url)
    server, thread, base_url = run(second_app)
    try:
        traffic.base = f"{base_url}/api/v1/experiments/{NAME}"
        after = traffic.experiment()
        for key in ("round", "probabilities", "deployed", "applied_rounds", "seed", "arms", "status"):
            assert after[key] == before[key], key
        assert traffic.session.get(f"{traffic.base}/rounds", timeout=30).json() == rounds_before
        assert traffic.session.post(f"{traffic.base}/assign", json={"unit": "sticky-user"}, timeout=30).json() == token
        assert sum(sum(entry["counts"]) for entry in rounds_before["rounds"]) == traffic.sent
        closed = traffic.session.post(f"{traffic.base}/rounds", timeout=30).json()
        assert closed["closed_round"] == 12 and closed["round"]["index"] == 13
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()
        get_db(second_app).engine.dispose()
