"""Ingestion: exactly-once, aggregated exactly, late observations kept and counted, on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import sqlalchemy as sa

from pasto.hashing import bucket, choose_arm, cumulative_probabilities
from service.db import get_db
from service.models import ArmRoundCount, RoundStatistic

OBSERVATIONS = "/api/v1/experiments/setup-a/observations"


def statistics_in_db(app) -> dict[tuple[int, int, int], tuple[int, float, float]]:
    with get_db(app).read() as session:
        rows = session.execute(sa.select(RoundStatistic)).scalars().all()
    return {(r.round_index, r.arm_index, r.metric_index): (r.count, r.sum, r.sum_of_squares) for r in rows}


def sticky_arm(seed: int, unit: str, round_index: int, probabilities) -> int:
    return choose_arm(cumulative_probabilities(probabilities), bucket(seed, unit, round_index))


def test_statistics_are_exact_and_ids_count_once(backend_api, setup_a):
    api = backend_api
    app = api.client.application
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    rng = np.random.default_rng(3)
    batch = []
    for i in range(400):
        values = {"x": float(rng.normal())}
        if i % 3:
            values["y"] = float(rng.normal(2.0, 1.0))  # metrics may arrive separately
        batch.append({"id": f"obs-{i}", "unit": f"user-{i % 150}", "round": 0, "values": values})
    first = api("POST", OBSERVATIONS, role="ingest", json={"observations": batch[:300] + batch[:20]})
    assert first.status_code == 202
    assert first.get_json() == {"accepted": 300, "duplicates": 20}
    second = api("POST", OBSERVATIONS, role="ingest", json={"observations": batch[250:]})
    assert second.get_json() == {"accepted": 100, "duplicates": 50}
    again = api("POST", OBSERVATIONS, role="ingest", json={"observations": batch})
    assert again.get_json() == {"accepted": 0, "duplicates": 400}

    expected: dict[tuple[int, int, int], list[float]] = {}
    for item in batch:
        arm = sticky_arm(7, item["unit"], 0, [0.5, 0.5])
        for metric, value in item["values"].items():
            expected.setdefault((0, arm, ["x", "y"].index(metric)), []).append(value)
    stored = statistics_in_db(app)
    assert set(stored) == set(expected)
    for key, values in expected.items():
        count, total, total_of_squares = stored[key]
        assert count == len(values)
        assert np.isclose(total, np.sum(values), rtol=1e-12, atol=1e-9)
        assert np.isclose(total_of_squares, np.sum(np.square(values)), rtol=1e-12, atol=1e-9)

    with get_db(app).read() as session:
        counts = session.execute(sa.select(ArmRoundCount)).scalars().all()
    assert sum(row.observations for row in counts) == 400
    assert sum(row.units for row in counts) == 150  # distinct units, for the SRM test
    assert sum(row.late_observations for row in counts) == 0


def test_late_observations_are_kept_counted_and_pooled(backend_api, setup_a):
    api = backend_api
    app = api.client.application
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    on_time = [{"id": f"a{i}", "unit": f"u{i}", "round": 0, "values": {"x": 1.0, "y": 1.0}} for i in range(10)]
    assert api("POST", OBSERVATIONS, role="ingest", json={"observations": on_time}).status_code == 202
    assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200
    late = [{"id": f"b{i}", "unit": f"v{i}", "round": 0, "values": {"x": 3.0}} for i in range(4)]
    response = api("POST", OBSERVATIONS, role="ingest", json={"observations": late})
    assert response.get_json() == {"accepted": 4, "duplicates": 0}

    rounds = api("GET", "/api/v1/experiments/setup-a/rounds", role="read").get_json()["rounds"]
    assert rounds[0]["late_observations"] == 4
    assert sum(rounds[0]["counts"]) == 14
    assert api("GET", "/api/v1/experiments/setup-a/diagnostics", role="read").get_json()["late_observations"] == 4
    x_count = sum(count for (round_index, _, metric), (count, _, _) in statistics_in_db(app).items()
                  if round_index == 0 and metric == 0)
    assert x_count == 14  # kept in round 0's statistics, so the next update's pooled estimate uses them


def test_omitted_arm_is_derived_from_the_sticky_assignment(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    units = [f"user-{i}" for i in range(50)]
    assigned = api("POST", "/api/v1/experiments/setup-a/assign", role="ingest", json={"units": units}).get_json()
    arm_of = {item["unit"]: item["arm"] for item in assigned["assignments"]}
    batch = [{"id": unit, "unit": unit, "round": 0, "values": {"x": 1.0}} for unit in units]
    assert api("POST", OBSERVATIONS, role="ingest", json={"observations": batch}).status_code == 202
    rounds = api("GET", "/api/v1/experiments/setup-a/rounds", role="read").get_json()["rounds"]
    assert rounds[0]["counts"] == [sum(arm == "a" for arm in arm_of.values()), sum(arm == "b" for arm in arm_of.values())]


def test_observations_for_an_earlier_round_use_that_rounds_assignment(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    round_zero = api("POST", "/api/v1/experiments/setup-a/assign", role="ingest",
                     json={"units": [f"u{i}" for i in range(40)]}).get_json()["assignments"]
    assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200
    batch = [{"id": item["unit"], "unit": item["unit"], "round": 0, "arm": item["arm"], "values": {"x": 0.5}}
             for item in round_zero]
    assert api("POST", OBSERVATIONS, role="ingest", json={"observations": batch}).get_json()["accepted"] == 40


def test_concurrent_writers_with_resent_ids_count_each_observation_once(backend_api, setup_a):
    """Four threads post overlapping batches (every id is sent by two writers) at the same time."""
    import threading

    api = backend_api
    app = api.client.application
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    rng = np.random.default_rng(11)
    observations = [{"id": f"obs-{i}", "unit": f"user-{i}", "round": 0,
                     "values": {"x": float(rng.normal()), "y": float(rng.normal())}} for i in range(800)]
    chunks = [observations[i:i + 100] for i in range(0, 800, 100)]
    plans = [chunks[0:4] + chunks[4:6], chunks[2:6], chunks[6:8] + chunks[0:2], chunks[6:8]]
    barrier = threading.Barrier(len(plans))
    accepted, errors = [], []

    def writer(plan):
        client = app.test_client()
        headers = {"Authorization": f"Bearer {api.tokens['ingest']}"}
        barrier.wait()
        for chunk in plan:
            response = client.post(OBSERVATIONS, json={"observations": chunk}, headers=headers)
            if response.status_code != 202:
                errors.append(response.get_data(as_text=True))
            else:
                accepted.append(response.get_json()["accepted"])

    threads = [threading.Thread(target=writer, args=(plan,)) for plan in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        # Hang guard, not a tolerance: the concurrent batches take a few seconds under load.
        thread.join(timeout=120)
    assert errors == []
    assert sum(accepted) == 800
    stored = statistics_in_db(app)
    assert sum(count for (_, _, metric), (count, _, _) in stored.items() if metric == 0) == 800
    total_x = sum(total for (_, _, metric), (_, total, _) in stored.items() if metric == 0)
    assert np.isclose(total_x, sum(item["values"]["x"] for item in observations), rtol=1e-12, atol=1e-9)


def test_unicode_and_sql_like_ids_are_plain_data(backend_api, setup_a):
    api = backend_api
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    strange = ["ünïcødé-🙂", "x'); DROP TABLE observation_ids; --", "%s %(name)s ?", "\\", "\"quoted\"", "a" * 256]
    batch = [{"id": text, "unit": text, "round": 0, "values": {"x": 1.0}} for text in strange]
    assert api("POST", OBSERVATIONS, role="ingest", json={"observations": batch}).get_json() == {
        "accepted": len(strange), "duplicates": 0}
    assert api("POST", OBSERVATIONS, role="ingest", json={"observations": batch}).get_json() == {
        "accepted": 0, "duplicates": len(strange)}
    rounds = api("GET", "/api/v1/experiments/setup-a/rounds", role="read").get_json()["rounds"]
    assert sum(rounds[0]["units"]) == len(strange)


def test_any_split_and_order_of_resent_batches_counts_each_id_once(api, app, setup_a):
    """Property: however observations are duplicated, split into batches and reordered, the stored
    statistics are those of the distinct ids."""
    import itertools

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    names = (f"prop-{i}" for i in itertools.count())
    values_of = {f"id-{i}": float(i % 7) - 3.0 for i in range(30)}

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(sends=st.lists(st.sampled_from(sorted(values_of)), min_size=1, max_size=60),
           cuts=st.lists(st.integers(1, 20), min_size=1, max_size=8))
    def check(sends, cuts):
        name = next(names)
        assert api("POST", "/api/v1/experiments", json=setup_a(name=name)).status_code == 201
        observations = [{"id": i, "unit": f"unit-{i}", "round": 0, "values": {"x": values_of[i]}} for i in sends]
        accepted = duplicates = 0
        start = 0
        for cut in itertools.cycle(cuts):
            if start >= len(observations):
                break
            batch = observations[start:start + cut]
            start += cut
            body = api("POST", f"/api/v1/experiments/{name}/observations", role="ingest",
                       json={"observations": batch}).get_json()
            accepted += body["accepted"]
            duplicates += body["duplicates"]
        distinct = set(sends)
        assert accepted == len(distinct) and duplicates == len(sends) - len(distinct)
        rounds = api("GET", f"/api/v1/experiments/{name}/rounds", role="read").get_json()["rounds"]
        assert sum(rounds[0]["counts"]) == len(distinct)
        means = [m for m in rounds[0]["means"]["x"] if m is not None]
        counts = rounds[0]["counts"]
        total = sum(mean * count for mean, count in zip(means, [c for c in counts if c]))
        assert total == pytest.approx(sum(values_of[i] for i in distinct), abs=1e-9)

    check()
