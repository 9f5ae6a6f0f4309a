"""Change detection in the service's rounds: the default preset re-learns when the means change."""

from __future__ import annotations

import json

import numpy as np
import sqlalchemy as sa

from pasto.algorithm import DETECTOR_SNAPSHOTS, ControllerState
from service import store
from service.db import get_db
from service.models import DetectorSnapshot, Experiment

EXPERIMENT = "/api/v1/experiments/drift"


def stored_state(app) -> ControllerState:
    """The state with the change detector's snapshots, which are stored apart (``detector_snapshots``)."""
    with get_db(app).read() as session:
        row = session.execute(sa.select(Experiment).where(Experiment.name == "drift")).scalar_one()
        assert not set(row.state) & set(DETECTOR_SNAPSHOTS)
        return ControllerState.from_dict({**row.state, **store.read_detector_snapshots(session, row.id, DETECTOR_SNAPSHOTS)})


def stored_snapshots(app) -> dict[str, str]:
    """The stored snapshot documents as JSON text, by name."""
    with get_db(app).read() as session:
        return {row.name: json.dumps(row.document, sort_keys=True)
                for row in session.execute(sa.select(DetectorSnapshot)).scalars()}


def play_round(api, rng, means: dict[str, float], units: int, round_number: int) -> None:
    """Assign ``units`` units from the served mixture, report x ~ N(means[arm], 0.3^2), close the round."""
    names = [f"r{round_number}u{i}" for i in range(units)]
    assigned = api("POST", f"{EXPERIMENT}/assign", role="ingest", json={"units": names}).get_json()["assignments"]
    noise = rng.normal(0.0, 0.3, size=len(assigned))
    observations = [{"id": item["unit"], "unit": item["unit"], "round": item["round"],
                     "values": {"x": means[item["arm"]] + float(e), "y": 1.0 + float(e)}}
                    for item, e in zip(assigned, noise)]
    response = api("POST", f"{EXPERIMENT}/observations", role="ingest", json={"observations": observations})
    assert response.status_code == 202, response.get_json()
    closed = api("POST", f"{EXPERIMENT}/rounds")
    assert closed.status_code == 200, closed.get_json()


def test_the_default_detects_swapped_means_through_the_controller_and_relearns(api, app, setup_a):
    """Arm a is better for 40 rounds, then the arms' means swap: the rounds closed by
    service/controller/rounds.py detect the change (the stored state counts it), drop the old
    evidence and deploy arm b; before the change there is no false alarm."""
    body = setup_a(name="drift", algorithm={"preset": "default", "change_every": 10})
    created = api("POST", "/api/v1/experiments", json=body)
    assert created.status_code == 201, created.get_json()
    assert created.get_json()["algorithm"]["serving"] == "safe"
    rng = np.random.default_rng(5)
    before, after = {"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 1.0}
    snapshots = stored_snapshots(app)
    for round_number in range(40):
        play_round(api, rng, before, 30, round_number)
        # The window origins are rewritten when the detector looks (every 10th round) and only then;
        # no change yet, so no change origin.
        now = stored_snapshots(app)
        assert "change_origin" not in now
        assert (now.get("window_origins") != snapshots.get("window_origins")) == ((round_number + 1) % 10 == 0)
        snapshots = now
    state = stored_state(app)
    assert state.changes.tolist() == 0
    assert state.deployed[0] > 0.99
    for round_number in range(40, 100):
        play_round(api, rng, after, 30, round_number)
    state = stored_state(app)
    assert state.changes.tolist() >= 1
    assert state.change_origin is not None
    assert state.deployed[1] > 0.99
    assert state.probabilities[1] > 0.9
    experiment = api("GET", EXPERIMENT, role="read").get_json()
    assert experiment["deployed"][1] > 0.99
