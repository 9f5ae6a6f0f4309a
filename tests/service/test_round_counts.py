"""``round_counts`` (per-round totals of ``arm_round_counts``, migration 0012) on SQLite and PostgreSQL:
after every kind of write to the per-arm counts (observations in-round and late, statistics batches
in-round and late, a segmented experiment, retention, a delete) it equals the GROUP BY over
``arm_round_counts`` that ``store.round_totals`` used to run (the oracle, ``tests/round_counts.py``),
and what ``round_totals`` and the diagnostics read is that table. The source path is checked in
``tests/sources/test_scheduled_rounds.py``, concurrent writers in ``tests/reliability``."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from service import store
from service.controller.retention import prune
from service.db import get_db
from service.models import Experiment, utcnow
from service.store import UnitOfWork
from tests.round_counts import assert_round_counts_match, grouped_arm_counts
from tests.service.conftest import Api
from tests.service.test_segments import segmented_body
from tests.service.test_statistics import assigned_observations, cells_of, create, path
from tests.service.test_statistics import service  # noqa: F401  (the fixture: (api, app) on each backend)


def experiment_id(app, name: str) -> int:
    with get_db(app).read() as session:
        return session.execute(sa.select(Experiment.id).where(Experiment.name == name)).scalar_one()


def totals_read(app, name: str) -> dict[int, tuple[int, int, int]]:
    """What ``store.round_totals`` answers for experiment ``name``: ``{round: (observations, units, late)}``."""
    with get_db(app).read() as session:
        rows = store.round_totals(session, [experiment_id(app, name)])
    return {round_index: (observations, units, late) for _, round_index, units, observations, late in rows}


def check(app, name: str) -> dict[int, tuple[int, int, int]]:
    """``round_counts`` equals the oracle for every experiment, and ``round_totals`` reads it."""
    totals = assert_round_counts_match(get_db(app).engine)
    identifier = experiment_id(app, name)
    expected = {round_index: sums for (owner, round_index), sums in totals.items() if owner == identifier}
    assert totals_read(app, name) == expected
    return expected


def post(api: Api, name: str, suffix: str, body: dict, status: int = 202) -> dict:
    answer = api("POST", path(name, suffix), role="ingest", json=body)
    assert answer.status_code == status, answer.get_json()
    return answer.get_json()


def test_round_counts_follow_observations_batches_late_data_and_retention(service):
    api, app = service
    create(api, "hooked")
    create(api, "pushed")
    observations = assigned_observations(api, "hooked", 0, 50, seed=1, prefix="h")
    post(api, "hooked", "/observations", {"observations": observations[:30]})
    assert check(app, "hooked") == {0: (30, 30, 0)}
    post(api, "hooked", "/observations", {"observations": observations})  # 30 resent: counted once
    assert check(app, "hooked") == {0: (50, 50, 0)}
    cells, units = cells_of(observations)
    post(api, "pushed", "/statistics", {"batch_id": "p-0", "cells": cells, "units": units})
    pushed = check(app, "pushed")
    assert pushed[0][1] == 50 and pushed[0][2] == 0  # units as sent, nothing late yet

    for name in ("hooked", "pushed"):
        assert api("POST", path(name, "/rounds"), json={"round": 0}).status_code == 200
    # Late observations for round 0 and in-round ones for round 1, in one request.
    late = [dict(o, id=f"late-{o['id']}", unit=f"late-{o['unit']}") for o in observations[:12]]
    unassigned = [{key: value for key, value in o.items() if key != "arm"} for o in late]  # sticky arm: the server's
    current = assigned_observations(api, "hooked", 1, 20, seed=2, prefix="c")
    post(api, "hooked", "/observations", {"observations": unassigned + current})
    hooked = check(app, "hooked")
    assert hooked[0] == (62, 62, 12) and hooked[1] == (20, 20, 0)
    # A late statistics batch for round 0 and one spanning rounds 0 and 1.
    late_cells, late_units = cells_of(late)
    post(api, "pushed", "/statistics", {"batch_id": "p-late", "cells": late_cells, "units": late_units})
    both_cells, both_units = cells_of(late + [dict(o, round=1) for o in current])
    post(api, "pushed", "/statistics", {"batch_id": "p-both", "cells": both_cells, "units": both_units})
    pushed = check(app, "pushed")
    assert pushed[0][2] > 0 and pushed[1][2] == 0  # round 0's new cells were late, round 1's were not
    assert api("GET", path("hooked", "/diagnostics")).get_json()["late_observations"] == 12

    database = get_db(app)
    result = prune(UnitOfWork.open(database), utcnow() + timedelta(seconds=3601), retention_seconds=3600)
    assert result.advanced  # round 0 of both pruned: ids and units go, the counts stay
    assert check(app, "hooked") == hooked
    assert check(app, "pushed") == pushed

    assert api("POST", path("pushed", "/archive")).status_code == 200
    deleted = api("DELETE", path("pushed", ""))
    assert deleted.status_code == 200 and deleted.get_json()["deleted_rows"]["round_counts"] == 2
    totals = assert_round_counts_match(database.engine)
    assert {owner for owner, _ in totals} == {experiment_id(app, "hooked")}


def test_a_segmented_experiment_keeps_round_counts(service):
    api, app = service
    assert api("POST", "/api/v1/experiments", json=segmented_body()).status_code == 201

    def observe(units: list[str], round_index: int, segment: str) -> None:
        answers = api("POST", "/api/v1/experiments/seg/assign", role="ingest",
                      json={"units": units, "segment": segment}).get_json()["assignments"]
        post(api, "seg", "/observations", {"observations": [
            {"id": f"{a['unit']}-{round_index}", "unit": a["unit"], "round": round_index, "segment": segment,
             "values": {"x": 1.0, "y": 0.5}} for a in answers]})

    observe([f"n{i}" for i in range(40)], 0, "new")
    observe([f"r{i}" for i in range(20)], 0, "returning")
    assert check(app, "seg") == {0: (60, 60, 0)}
    assert api("POST", "/api/v1/experiments/seg/rounds", json={"round": 0}).status_code == 200
    post(api, "seg", "/observations", {"observations": [
        {"id": f"late-{i}", "unit": f"late{i}", "round": 0, "segment": "mobile", "values": {"x": 2.0}}
        for i in range(10)]})
    observe([f"m{i}" for i in range(15)], 1, "mobile")
    assert check(app, "seg") == {0: (70, 70, 10), 1: (15, 15, 0)}


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_upgrade_fills_round_counts_from_existing_counts(backend, request):
    """0012 on a database with counts: ``round_counts`` holds their sums over the arms per experiment and
    round; the downgrade drops it and leaves ``arm_round_counts`` as it was."""
    import migrations

    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0011")
    rows = [(experiment, round_index, arm, 10 * experiment + round_index + arm, round_index + arm, arm % 2)
            for experiment in (1, 2) for round_index in range(3) for arm in range(4)
            if not (experiment == 2 and round_index == 1)]
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            for experiment in (1, 2):
                connection.execute(sa.text(
                    "INSERT INTO experiments (id, name, config, status, seed, round_index, applied_rounds, state, "
                    "version, created_at, updated_at) VALUES (:id, :name, '{}', 'running', 1, 2, 2, '{}', 1, "
                    "'2026-01-01', '2026-01-01')"), {"id": experiment, "name": f"e{experiment}"})
            connection.execute(sa.text(
                "INSERT INTO arm_round_counts (experiment_id, round_index, arm_index, observations, units, "
                "late_observations) VALUES (:e, :r, :a, :o, :u, :l)"),
                [dict(zip("eraoul", row)) for row in rows])
        with engine.connect() as connection:
            expected = grouped_arm_counts(connection)
        assert len(expected) == 5
        migrations.upgrade(url, "0012")
        assert assert_round_counts_match(engine) == expected
        assert expected[(1, 2)] == (4 * 12 + 6, 4 * 2 + 6, 2)
        migrations.downgrade(url, "0011")
        assert "round_counts" not in sa.inspect(engine).get_table_names()
        with engine.connect() as connection:
            assert grouped_arm_counts(connection) == expected
    finally:
        engine.dispose()
