"""Retention in a running ``pasto serve``: its scheduler prunes the ids of applied rounds, and a resend of
a pruned round (observations or a statistics batch) is refused 409 with the counts unchanged.

The server runs with ``PASTO_RETENTION_SECONDS=0`` (a round's ids go as soon as its update ran) and
``PASTO_RETENTION_CHECK_SECONDS=0.5``; rounds are closed by hand (1-hour rounds), so the test decides
which round is applied.
"""

from __future__ import annotations

import time

import pytest
import requests
import sqlalchemy as sa

from service.models import ArmRoundCount, Experiment, ObservationId, RoundStatistic, RoundUnit, StatisticsBatch
from tests.reliability.harness import ADMIN_TOKEN, NAME, create_experiment

HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
API = f"/api/v1/experiments/{NAME}"
SETTINGS = {"PASTO_RETENTION_SECONDS": "0", "PASTO_RETENTION_CHECK_SECONDS": "0.5"}


def counts(engine: sa.Engine) -> tuple:
    with engine.connect() as connection:
        statistics = connection.execute(sa.select(RoundStatistic.round_index, RoundStatistic.arm_index,
                                                  RoundStatistic.metric_index, RoundStatistic.count,
                                                  RoundStatistic.sum).order_by(RoundStatistic.round_index,
                                                                               RoundStatistic.arm_index,
                                                                               RoundStatistic.metric_index)).all()
        arm_counts = connection.execute(sa.select(ArmRoundCount.round_index, ArmRoundCount.arm_index,
                                                  ArmRoundCount.observations, ArmRoundCount.units)
                                        .order_by(ArmRoundCount.round_index, ArmRoundCount.arm_index)).all()
    return tuple(statistics), tuple(arm_counts)


def rows(engine: sa.Engine, model) -> int:
    with engine.connect() as connection:
        return connection.execute(sa.select(sa.func.count()).select_from(model)).scalar_one()


@pytest.mark.parametrize("database", ["migrated_sqlite", pytest.param("migrated_postgres", marks=pytest.mark.postgres)])
def test_the_scheduler_prunes_and_a_resend_of_a_pruned_round_is_refused(database, request, service_processes,
                                                                        inspect_engine):
    url = request.getfixturevalue(database)
    server = service_processes.serve(url, scheduler=True, scheduler_interval=0.2, settings=SETTINGS)
    engine = inspect_engine(url)
    create_experiment(server.url)
    assignments = requests.post(f"{server.url}{API}/assign", json={"units": [f"u{i}" for i in range(50)]},
                                headers=HEADERS, timeout=30).json()["assignments"]
    observations = {"observations": [
        {"id": f"o{i}", "unit": a["unit"], "round": a["round"], "arm": a["arm"], "values": {"x": float(i), "y": 1.0}}
        for i, a in enumerate(assignments)]}
    batch = {"batch_id": "job/round-0", "cells": [
        {"round": 0, "arm": "a", "metric": "x", "count": 4, "sum": 2.0, "sum_of_squares": 3.0}],
        "units": [{"round": 0, "arm": "a", "units": 2}]}
    assert requests.post(f"{server.url}{API}/observations", json=observations, headers=HEADERS,
                         timeout=30).status_code == 202
    assert requests.post(f"{server.url}{API}/statistics", json=batch, headers=HEADERS, timeout=30).status_code == 202
    # Within the round (not applied yet): a resend is a duplicate, nothing is pruned.
    time.sleep(1.5)
    assert requests.post(f"{server.url}{API}/statistics", json=batch, headers=HEADERS,
                         timeout=30).json()["duplicate"] is True
    assert (rows(engine, ObservationId), rows(engine, RoundUnit), rows(engine, StatisticsBatch)) == (50, 50, 1)

    assert requests.post(f"{server.url}{API}/rounds", json={"round": 0}, headers=HEADERS, timeout=30).status_code == 200
    deadline = time.monotonic() + 30
    while rows(engine, ObservationId) or rows(engine, StatisticsBatch) or rows(engine, RoundUnit):
        assert time.monotonic() < deadline, "the scheduler did not prune round 0's ids within 30 s"
        time.sleep(0.2)
    with engine.connect() as connection:
        assert connection.execute(sa.select(Experiment.pruned_rounds)).scalar_one() == 1
    assert "Retention: pruned rounds below" in server.log()

    before = counts(engine)
    for route, body in (("observations", observations), ("statistics", batch)):
        refused = requests.post(f"{server.url}{API}/{route}", json=body, headers=HEADERS, timeout=30)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "round_pruned" and error["details"] == {"round": 0, "pruned_rounds": 1}
    assert counts(engine) == before
    rounds = requests.get(f"{server.url}{API}/rounds", headers=HEADERS, timeout=30).json()["rounds"]
    assert sum(rounds[0]["counts"]) == 50 + 4  # the observations and the batch's cell, once each
