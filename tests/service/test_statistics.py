"""``POST .../statistics`` and retention, on SQLite and PostgreSQL: cells add to a round exactly as the
same observations through the webhook would, a batch applies once, a pruned round refuses data."""

from __future__ import annotations

import sqlite3
from datetime import timedelta

import numpy as np
import pytest
import sqlalchemy as sa

from pasto.estimators import Statistics
from service.auth import create_token
from service.controller.retention import prune
from service.db import get_db
from service.store import UnitOfWork
from service.models import (ArmRoundCount, Experiment, LateStatistic, ObservationId, RoundStatistic, RoundUnit,
                            StatisticsBatch, utcnow)
from tests.service.conftest import Api, make_app, setup_a_body

ARMS = ("a", "b")
METRICS = ("x", "y")


@pytest.fixture
def service(backend_url):
    """``(api, app)`` on a migrated database of each backend."""
    application = make_app(backend_url)
    with get_db(application).write() as session:
        role_tokens = {role: create_token(session, role, f"test-{role}") for role in ("read", "ingest", "admin")}
    yield Api(application.test_client(), role_tokens), application
    get_db(application).engine.dispose()


def path(name: str, suffix: str) -> str:
    return f"/api/v1/experiments/{name}{suffix}"


def create(api: Api, name: str) -> None:
    assert api("POST", "/api/v1/experiments", json=setup_a_body(name)).status_code == 201


def assigned_observations(api: Api, name: str, round_index: int, n: int, seed: int, prefix: str) -> list[dict]:
    """``n`` observations of the units' sticky arms in the current round (which must be ``round_index``),
    some with only one metric."""
    rng = np.random.default_rng(seed)
    units = [f"{prefix}-u{i}" for i in range(n)]
    answer = api("POST", path(name, "/assign"), role="ingest", json={"units": units}).get_json()
    observations = []
    for i, assignment in enumerate(answer["assignments"]):
        assert assignment["round"] == round_index
        values = {"x": float(rng.normal(2.0, 1.0)), "y": float(rng.normal(-1.0, 2.0))}
        if i % 5 == 0:
            del values["y"]
        observations.append({"id": f"{prefix}-o{i}", "unit": assignment["unit"], "round": round_index,
                             "arm": assignment["arm"], "values": values})
    return observations


def cells_of(observations: list[dict]) -> tuple[list[dict], list[dict]]:
    """The statistics cells and units entries a stream job would compute from ``observations``."""
    cells, units = [], []
    for round_index in sorted({o["round"] for o in observations}):
        for arm in ARMS:
            members = [o for o in observations if o["round"] == round_index and o["arm"] == arm]
            if members:
                units.append({"round": round_index, "arm": arm, "units": len({o["unit"] for o in members})})
            for metric in METRICS:
                values = np.array([o["values"][metric] for o in members if metric in o["values"]])
                if values.size:
                    cells.append({"round": round_index, "arm": arm, "metric": metric, "count": int(values.size),
                                  "sum": float(values.sum()), "sum_of_squares": float((values ** 2).sum())})
    return cells, units


def stored(app, name: str) -> dict:
    """Every statistics row of experiment ``name``, keyed, without the experiment id."""
    with get_db(app).read() as session:
        experiment_id = session.execute(sa.select(Experiment.id).where(Experiment.name == name)).scalar_one()
        statistics = {(r.round_index, r.arm_index, r.metric_index): (r.count, r.sum, r.sum_of_squares)
                      for r in session.execute(sa.select(RoundStatistic)
                                               .where(RoundStatistic.experiment_id == experiment_id)).scalars()}
        counts = {(r.round_index, r.arm_index): (r.observations, r.units, r.late_observations)
                  for r in session.execute(sa.select(ArmRoundCount)
                                           .where(ArmRoundCount.experiment_id == experiment_id)).scalars()}
        late = {(r.metric_index, r.arm_index): (r.count, r.sum, r.sum_of_squares)
                for r in session.execute(sa.select(LateStatistic)
                                         .where(LateStatistic.experiment_id == experiment_id)).scalars()}
    return {"statistics": statistics, "counts": counts, "late": late}


def assert_close(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for key in left:
        assert left[key][0] == right[key][0], key  # counts exactly
        np.testing.assert_allclose(left[key][1:], right[key][1:], rtol=1e-12, atol=1e-12, err_msg=str(key))


def test_cells_add_to_a_round_exactly_as_the_same_observations(service):
    """Experiment "hooked" gets observations through the webhook; "pushed" gets half of the same data as
    observations and the other half as one statistics batch (the same units per arm, as each half has its
    own units): the stored statistics, the rounds history, the update and the diagnostics agree."""
    api, app = service
    for name in ("hooked", "pushed"):
        create(api, name)
    first = assigned_observations(api, "hooked", 0, 120, seed=1, prefix="h1")
    second = assigned_observations(api, "hooked", 0, 80, seed=2, prefix="h2")
    assert api("POST", path("hooked", "/observations"), role="ingest",
               json={"observations": first + second}).status_code == 202
    assert api("POST", path("pushed", "/observations"), role="ingest", json={"observations": first}).status_code == 202
    cells, units = cells_of(second)
    answer = api("POST", path("pushed", "/statistics"), role="ingest",
                 json={"batch_id": "job-1/round-0", "cells": cells, "units": units})
    assert answer.status_code == 202
    assert answer.get_json() == {"batch_id": "job-1/round-0", "duplicate": False, "cells": len(cells),
                                 "units": len(units), "late_cells": 0}
    hooked, pushed = stored(app, "hooked"), stored(app, "pushed")
    assert_close(hooked["statistics"], pushed["statistics"])
    assert hooked["counts"] == pushed["counts"]  # every observation has x: the largest count is exact

    for name in ("hooked", "pushed"):
        assert api("POST", path(name, "/rounds"), json={"round": 0}).status_code == 200
    rounds = {name: api("GET", path(name, "/rounds")).get_json()["rounds"][0] for name in ("hooked", "pushed")}
    assert rounds["hooked"]["counts"] == rounds["pushed"]["counts"]
    assert rounds["hooked"]["units"] == rounds["pushed"]["units"]
    for metric in METRICS:
        np.testing.assert_allclose(rounds["hooked"]["means"][metric], rounds["pushed"]["means"][metric], rtol=1e-12)
    np.testing.assert_allclose(rounds["hooked"]["deployed"], rounds["pushed"]["deployed"], rtol=1e-9)
    diagnostics = {name: api("GET", path(name, "/diagnostics")).get_json() for name in ("hooked", "pushed")}
    assert diagnostics["hooked"]["units"] == diagnostics["pushed"]["units"]
    assert diagnostics["hooked"]["srm"]["p_value"] == pytest.approx(diagnostics["pushed"]["srm"]["p_value"])


def test_a_batch_applies_once_and_other_content_under_its_id_is_409(service):
    api, app = service
    create(api, "once")
    cells, units = cells_of(assigned_observations(api, "once", 0, 50, seed=3, prefix="o"))
    body = {"batch_id": "b-1", "cells": cells, "units": units}
    assert api("POST", path("once", "/statistics"), role="ingest", json=body).status_code == 202
    before = stored(app, "once")
    # The same content in another order, with integral sums written as integers: still the same batch.
    reordered = {"batch_id": "b-1", "cells": [dict(c, count=int(c["count"])) for c in reversed(cells)],
                 "units": list(reversed(units))}
    again = api("POST", path("once", "/statistics"), role="ingest", json=reordered)
    assert again.status_code == 200
    assert again.get_json() == {"batch_id": "b-1", "duplicate": True, "cells": 0, "units": 0, "late_cells": 0}
    changed = {**body, "cells": [dict(cells[0], count=cells[0]["count"] + 1,
                                      sum_of_squares=cells[0]["sum_of_squares"] + 1.0)] + cells[1:]}
    conflict = api("POST", path("once", "/statistics"), role="ingest", json=changed)
    assert conflict.status_code == 409
    error = conflict.get_json()["error"]
    assert error["code"] == "conflict" and "'b-1'" in error["message"] and error["details"] == {"batch_id": "b-1"}
    assert stored(app, "once") == before


def test_cells_for_an_applied_round_are_late_data(service):
    api, app = service
    create(api, "late")
    observations = assigned_observations(api, "late", 0, 60, seed=4, prefix="l")
    assert api("POST", path("late", "/rounds"), json={"round": 0}).status_code == 200
    cells, units = cells_of(observations)
    answer = api("POST", path("late", "/statistics"), role="ingest",
                 json={"batch_id": "late-0", "cells": cells, "units": units}).get_json()
    assert answer["late_cells"] == len(cells) == answer["cells"]
    rows = stored(app, "late")
    late_total = sum(count for count, _, _ in rows["late"].values())
    assert late_total == sum(c["count"] for c in cells)
    assert api("GET", path("late", "/diagnostics")).get_json()["late_observations"] == sum(
        observations for observations, _, _ in rows["counts"].values())
    # The next update folds the late cells into the pooled statistics: nothing is left waiting.
    assert api("POST", path("late", "/rounds"), json={"round": 1}).status_code == 200
    assert stored(app, "late")["late"] == {}


def test_retention_prunes_old_rounds_and_refuses_their_data(service):
    """Round 0 is applied, then pruned: its ids, units and batch ids are gone, a resend of an observation
    or a batch of round 0 is a 409 round_pruned and changes no count; round 1 still takes data."""
    api, app = service
    create(api, "kept")
    observations = assigned_observations(api, "kept", 0, 40, seed=5, prefix="k")
    cells, units = cells_of(observations)
    batch = {"batch_id": "k-0", "cells": cells, "units": units}
    assert api("POST", path("kept", "/observations"), role="ingest",
               json={"observations": observations}).status_code == 202
    assert api("POST", path("kept", "/statistics"), role="ingest", json=batch).status_code == 202
    assert api("POST", path("kept", "/rounds"), json={"round": 0}).status_code == 200
    database = get_db(app)

    nothing = prune(UnitOfWork.open(database), utcnow(), retention_seconds=3600)  # applied just now: within the window
    assert nothing.advanced == {} and not any(nothing.deleted.values())
    assert prune(UnitOfWork.open(database), utcnow() + timedelta(days=30), retention_seconds=None).advanced == {}  # forever

    before = stored(app, "kept")
    result = prune(UnitOfWork.open(database), utcnow() + timedelta(seconds=3601), retention_seconds=3600, chunk_rows=7)
    assert list(result.advanced.values()) == [1] and result.finished
    assert result.deleted == {"observation_ids": 40, "round_units": 40, "statistics_batches": 1}
    with database.read() as session:
        assert session.execute(sa.select(Experiment.pruned_rounds).where(Experiment.name == "kept")).scalar_one() == 1
        for model in (ObservationId, RoundUnit, StatisticsBatch):
            assert session.execute(sa.select(sa.func.count()).select_from(model)).scalar_one() == 0

    refused = api("POST", path("kept", "/observations"), role="ingest", json={"observations": observations[:3]})
    assert refused.status_code == 409
    error = refused.get_json()["error"]
    assert error["code"] == "round_pruned" and error["details"] == {"round": 0, "pruned_rounds": 1}
    assert "pruned" in error["message"] and error["message"].endswith(".")
    refused = api("POST", path("kept", "/statistics"), role="ingest", json=batch)
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "round_pruned"
    assert stored(app, "kept") == before

    current = assigned_observations(api, "kept", 1, 10, seed=6, prefix="k1")
    assert api("POST", path("kept", "/observations"), role="ingest", json={"observations": current}).status_code == 202
    # Pruning is idempotent: a second run finds nothing more to do.
    again = prune(UnitOfWork.open(database), utcnow() + timedelta(seconds=3601), retention_seconds=3600)
    assert again.advanced == {} and not any(again.deleted.values())


def test_retention_deletes_in_bounded_chunks(service):
    api, app = service
    create(api, "chunks")
    observations = assigned_observations(api, "chunks", 0, 30, seed=7, prefix="c")
    assert api("POST", path("chunks", "/observations"), role="ingest",
               json={"observations": observations}).status_code == 202
    assert api("POST", path("chunks", "/rounds"), json={"round": 0}).status_code == 200
    database = get_db(app)
    later = utcnow() + timedelta(seconds=10)
    partial = prune(UnitOfWork.open(database), later, retention_seconds=0, chunk_rows=10, max_chunks=2)
    assert not partial.finished and partial.deleted["observation_ids"] == 20
    rest = prune(UnitOfWork.open(database), later, retention_seconds=0, chunk_rows=10, max_chunks=100)
    assert rest.finished and rest.advanced == {}  # already advanced by the first call
    assert rest.deleted == {"observation_ids": 10, "round_units": 30, "statistics_batches": 0}


def test_statistics_while_sqlite_is_locked_answer_503_with_retry_after(tmp_path):
    url = f"sqlite:///{tmp_path / 'locked.sqlite'}"
    app = make_app(url, PASTO_SQLITE_BUSY_TIMEOUT=0.3)
    with get_db(app).write() as session:
        token = create_token(session, "ingest", "ingest")
    api = Api(app.test_client(), {"ingest": token, "admin": token})
    from tests.service.conftest import ADMIN_TOKEN
    assert app.test_client().post("/api/v1/experiments", json=setup_a_body("busy"),
                                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).status_code == 201
    body = {"batch_id": "busy-1", "cells": [{"round": 0, "arm": "a", "metric": "x", "count": 1, "sum": 1.0,
                                             "sum_of_squares": 1.0}]}
    holder = sqlite3.connect(str(tmp_path / "locked.sqlite"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        refused = api("POST", path("busy", "/statistics"), role="ingest", json=body)
        assert refused.status_code == 503, refused.get_data(as_text=True)
        assert refused.get_json()["error"]["code"] == "database_unavailable"
        assert int(refused.headers["Retry-After"]) > 0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert api("POST", path("busy", "/statistics"), role="ingest", json=body).status_code == 202
    get_db(app).engine.dispose()


def test_statistics_need_the_same_sums_as_the_estimator():
    """The cells_of helper of these tests computes what ``Statistics.from_observations`` does."""
    values = np.array([[1.0, np.nan], [2.0, 3.0], [4.0, 5.0]])
    statistics = Statistics.from_observations(np.array([0, 0, 0]), values, 1)
    observations = [{"round": 0, "arm": "a", "unit": f"u{i}",
                     "values": {m: float(v) for m, v in zip(METRICS, row) if not np.isnan(v)}}
                    for i, row in enumerate(values)]
    cells, units = cells_of(observations)
    assert [c["count"] for c in cells] == statistics.counts[:, 0].astype(int).tolist()
    assert [c["sum"] for c in cells] == statistics.sums[:, 0].tolist()
    assert [c["sum_of_squares"] for c in cells] == statistics.sums_of_squares[:, 0].tolist()
    assert units == [{"round": 0, "arm": "a", "units": 3}]
