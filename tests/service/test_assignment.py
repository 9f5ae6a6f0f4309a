"""Assignment: sticky per round, identical to pasto.hashing, batch == single, fresh after a round closes."""

from __future__ import annotations

import numpy as np

from pasto.hashing import bucket, choose_arm, cumulative_probabilities
from service import create_app
from service.db import get_db

ASSIGN = "/api/v1/experiments/setup-a/assign"


def expected_arm(seed: int, unit: str, round_index: int, probabilities) -> int:
    return choose_arm(cumulative_probabilities(probabilities), bucket(seed, unit, round_index))


def test_assignment_is_sticky_and_matches_the_shared_hash(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a(seed=123)).status_code == 201
    units = [f"user-{i}" for i in range(500)] + ["ünïcødé-🙂", "x' OR 1=1; --"]
    batch = api("POST", ASSIGN, role="ingest", json={"units": units}).get_json()["assignments"]
    assert [item["unit"] for item in batch] == units
    arms = ["a", "b"]
    for item in batch:
        single = api("POST", ASSIGN, role="ingest", json={"unit": item["unit"]}).get_json()
        assert single == item
        assert item["round"] == 0
        assert item["probability"] == 0.5
        assert item["arm"] == arms[expected_arm(123, item["unit"], 0, [0.5, 0.5])]
        assert item["params"] == ({"weight": 1.0} if item["arm"] == "a" else {"weight": 0.0})
    share = np.mean([item["arm"] == "a" for item in batch])
    assert 0.4 < share < 0.6


def test_a_new_round_reassigns_with_the_new_mixture_in_every_worker(app, api, setup_a, sqlite_url, admin_token):
    """A second app on the same database stands for another worker process: it sees the new round
    through the version check, without any restart."""
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    other = create_app({"PASTO_DATABASE_URL": sqlite_url, "PASTO_ADMIN_TOKEN": admin_token,
                        "PASTO_VERSION_CHECK_SECONDS": 0}).test_client()
    headers = {"Authorization": f"Bearer {admin_token}"}
    assert other.post(ASSIGN, json={"unit": "u1"}, headers=headers).get_json()["round"] == 0
    # Each unit's values are its round-0 arm's setup-A means (a: x 2, y -2; b: x 0, y 2) plus noise,
    # so the round's data tell the arms apart and the new mixture differs from the uniform start.
    noise = np.random.default_rng(3).normal(0.0, 0.5, (100, 2))
    truth = {0: (2.0, -2.0), 1: (0.0, 2.0)}
    observations = []
    for i in range(100):
        x, y = truth[expected_arm(7, f"u{i}", 0, [0.5, 0.5])]
        observations.append({"id": f"o{i}", "unit": f"u{i}", "round": 0,
                             "values": {"x": x + noise[i, 0], "y": y + noise[i, 1]}})
    assert api("POST", "/api/v1/experiments/setup-a/observations", json={"observations": observations}).status_code == 202
    closed = api("POST", "/api/v1/experiments/setup-a/rounds").get_json()
    probabilities = closed["probabilities"]
    assert probabilities != [0.5, 0.5]
    units = [f"user-{i}" for i in range(200)]
    batch = other.post(ASSIGN, json={"units": units}, headers=headers).get_json()["assignments"]
    for item in batch:
        assert item["round"] == 1
        arm = expected_arm(7, item["unit"], 1, probabilities)
        assert item["arm"] == ["a", "b"][arm]
        assert item["probability"] == probabilities[arm]
    get_db(other.application).engine.dispose()


def test_a_stopped_experiment_serves_the_deployed_mixture(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    observations = [{"id": f"o{i}", "unit": f"u{i}", "round": 0, "values": {"x": 1.0, "y": 1.0}} for i in range(20)]
    api("POST", "/api/v1/experiments/setup-a/observations", json={"observations": observations})
    api("POST", "/api/v1/experiments/setup-a/rounds")
    stopped = api("POST", "/api/v1/experiments/setup-a/stop").get_json()
    assert stopped["status"] == "stopped"
    deployed = stopped["deployed"]
    batch = api("POST", ASSIGN, role="ingest", json={"units": [f"z{i}" for i in range(100)]}).get_json()["assignments"]
    for item in batch:
        arm = expected_arm(7, item["unit"], stopped["round"]["index"], deployed)
        assert item["arm"] == ["a", "b"][arm]
        assert item["probability"] == deployed[arm]


def test_a_batch_of_ten_thousand_units(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    units = [f"unit-{i}" for i in range(10_000)]
    batch = api("POST", ASSIGN, role="ingest", json={"units": units}).get_json()["assignments"]
    assert len(batch) == 10_000
    for item in batch[::997]:
        assert item["arm"] == ["a", "b"][expected_arm(7, item["unit"], 0, [0.5, 0.5])]


def test_ingestion_refreshes_a_stale_worker_before_rejecting_a_round(app, api, setup_a, sqlite_url, admin_token):
    """A worker whose cache is still within its check interval accepts observations for a round that
    another worker started (it re-checks the version before calling the round "not started")."""
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    stale = create_app({"PASTO_DATABASE_URL": sqlite_url, "PASTO_ADMIN_TOKEN": admin_token,
                        "PASTO_VERSION_CHECK_SECONDS": 3600}).test_client()
    headers = {"Authorization": f"Bearer {admin_token}"}
    assert stale.post(ASSIGN, json={"unit": "u1"}, headers=headers).get_json()["round"] == 0
    assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200
    assert stale.post(ASSIGN, json={"unit": "u1"}, headers=headers).get_json()["round"] == 0  # within its interval
    observation = {"id": "o1", "unit": "u1", "round": 1, "values": {"x": 1.0}}
    response = stale.post("/api/v1/experiments/setup-a/observations", json={"observations": [observation]},
                          headers=headers)
    assert response.status_code == 202
    assert stale.post(ASSIGN, json={"unit": "u1"}, headers=headers).get_json()["round"] == 1
    get_db(stale.application).engine.dispose()


WIRE_UNITS = ["user-1", 'quote"and\\backslash', "ünïcødé-🙂", "tab\tand\nnewline", "\u2028", "x' OR 1=1; --", "user-1"]


def jsonify_bytes(app, body) -> bytes:
    """What ``flask.jsonify`` writes for ``body`` with ``app``'s settings (the reference encoding)."""
    from service.responses import respond_json

    with app.test_request_context():
        return respond_json(body).get_data()


def wire_dicts(app, name: str, units: list[str], segments: list[str] | None = None) -> list[dict]:
    """The answers for ``units`` computed from the cached snapshot with the shared hash, as dicts."""
    from service.bootstrap import get_uow
    from service.responses import assignments

    with app.app_context():
        snapshot = get_uow(app).cache.get(name, fresh=True)
    if segments is None:
        arms = [choose_arm(snapshot.serving_cumulative, snapshot.hasher(unit)) for unit in units]
        probabilities = [float(snapshot.serving[arm]) for arm in arms]
    else:
        rows = [snapshot.segment_positions[segment] for segment in segments]
        arms = [choose_arm(snapshot.segment_serving_cumulative[row], snapshot.hasher(unit))
                for row, unit in zip(rows, units)]
        probabilities = [float(snapshot.segment_serving[row, arm]) for row, arm in zip(rows, arms)]
    return assignments(units, arms, probabilities, snapshot.arm_names, snapshot.arm_params, snapshot.round_index,
                       segments)


def test_assign_answers_are_byte_for_byte_what_jsonify_writes(app, api, setup_a):
    """The assign route writes its answers from per-arm JSON members; the bytes are jsonify's, single
    and batch, for units that need escaping, on a mixture that is not uniform, in debug mode too."""
    body = setup_a(seed=5, arms=[{"name": f"arm-{k}", "params": {"w": k / 7, "label": f"é{k}", "nested": [k, None]}}
                                 for k in range(7)])
    assert api("POST", "/api/v1/experiments", json=body).status_code == 201
    expected = wire_dicts(app, "setup-a", WIRE_UNITS)
    assert len({item["arm"] for item in expected}) > 1
    for unit, item in zip(WIRE_UNITS, expected):
        response = api("POST", ASSIGN, role="ingest", json={"unit": unit})
        assert response.status_code == 200 and response.mimetype == "application/json"
        assert response.get_data() == jsonify_bytes(app, item)
    batch = api("POST", ASSIGN, role="ingest", json={"units": WIRE_UNITS})
    assert batch.get_data() == jsonify_bytes(app, {"assignments": expected})
    app.debug = True  # jsonify indents in debug mode: the route then answers through it
    try:
        assert api("POST", ASSIGN, role="ingest", json={"units": WIRE_UNITS}).get_data() == jsonify_bytes(
            app, {"assignments": expected})
        assert b"\n  " in jsonify_bytes(app, {"assignments": expected})
    finally:
        app.debug = False


def test_segmented_assign_answers_are_byte_for_byte_what_jsonify_writes(app, api):
    from tests.service.test_segments import segmented_body

    assert api("POST", "/api/v1/experiments", json=segmented_body()).status_code == 201
    segments = ["mobile", "new", "returning", "mobile", "returning", "new", "mobile"]
    expected = wire_dicts(app, "seg", WIRE_UNITS, segments)
    batch = api("POST", "/api/v1/experiments/seg/assign", role="ingest", json={"units": WIRE_UNITS, "segments": segments})
    assert batch.get_data() == jsonify_bytes(app, {"assignments": expected})
    for unit, segment, item in zip(WIRE_UNITS, segments, expected):
        response = api("POST", "/api/v1/experiments/seg/assign", role="ingest", json={"unit": unit, "segment": segment})
        assert response.get_data() == jsonify_bytes(app, item)
