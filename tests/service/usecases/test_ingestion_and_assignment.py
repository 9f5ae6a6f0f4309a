"""Assignment and ingestion (``service.controller.assignment``, ``ingestion``, ``statistics``) against a
real store: the sticky arm, exactly-once counting, all-or-nothing batches."""

from __future__ import annotations

import numpy as np
import pytest

from pasto.hashing import bucket, choose_arm, cumulative_probabilities
from service.controller import assignment, reports
from service.errors import ApiError

from .conftest import create, observe, push_statistics


def test_assignment_is_the_hash_of_seed_unit_and_round(uow):
    snapshot = create(uow, "feed")
    served, stale, arm, probability, segment = assignment.assign_one(uow, "feed", "user-1")
    assert served.id == snapshot.id and stale is False and segment is None
    assert arm == choose_arm(cumulative_probabilities([0.5, 0.5]), bucket(7, "user-1", 0)) and probability == 0.5
    _, _, arms, probabilities, _ = assignment.assign_many(uow, "feed", [f"user-{i}" for i in range(200)])
    assert arms[1] == arm and np.all(probabilities == 0.5) and 60 < int(arms.sum()) < 140


def test_assignment_records_exposures_when_given_a_recorder(uow):
    class Recorder:
        def __init__(self):
            self.calls = []

        def record(self, snapshot, units, arms, segments):
            self.calls.append((snapshot.name, list(units), [int(a) for a in arms], segments))

    create(uow, "feed")
    recorder = Recorder()
    _, _, arm, _, _ = assignment.assign_one(uow, "feed", "u", exposures=recorder)
    _, _, arms, _, _ = assignment.assign_many(uow, "feed", ["u", "v"], exposures=recorder)
    assert recorder.calls == [("feed", ["u"], [arm], None), ("feed", ["u", "v"], arms.tolist(), None)]


def test_an_unknown_experiment_is_a_404(uow):
    with pytest.raises(ApiError) as error:
        assignment.assign_one(uow, "nothing", "u")
    assert (error.value.status, error.value.code) == (404, "not_found")


def observation(i: int, x: float = 1.0, **extra):
    return {"id": f"o{i}", "unit": f"u{i}", "round": 0, "values": {"x": x, "y": 0.5}, **extra}


def test_observations_are_counted_once_per_id(uow):
    create(uow, "feed")
    first = observe(uow, "feed", [observation(i, float(i)) for i in range(10)])
    assert (first.accepted, first.duplicates) == (10, 0) and sum(first.arm_counts.values()) == 10
    again = observe(uow, "feed", [observation(i, float(i)) for i in range(5, 15)])
    assert (again.accepted, again.duplicates) == (5, 5)
    history = reports.round_history(uow, "feed", 0, None)
    assert int(history.counts.sum()) == 15 and int(history.units.sum()) == 15
    # The means per arm are those of the stored x values, each once.
    arms = assignment.assign_many(uow, "feed", [f"u{i}" for i in range(15)])[2]
    for arm in (0, 1):
        values = [float(i) for i in range(15) if arms[i] == arm]
        assert history.means[0, 0, arm] == pytest.approx(np.mean(values))


def test_a_batch_with_a_problem_is_refused_whole(uow):
    create(uow, "feed")
    sticky = assignment.assign_one(uow, "feed", "u1")[2]
    wrong = "b" if sticky == 0 else "a"
    batch = [observation(0), observation(1, arm=wrong), {"id": "o2", "unit": "u2", "round": 0, "values": {"z": 1.0}},
             {"id": "o3", "unit": "u3", "round": 4, "values": {"x": 1.0}}]
    with pytest.raises(ApiError) as error:
        observe(uow, "feed", batch)
    assert error.value.status == 422
    assert [problem["location"] for problem in error.value.details] == [
        "observations[1].arm", "observations[2].values.z", "observations[3].round"]
    assert int(reports.round_history(uow, "feed", 0, None).counts.sum()) == 0  # nothing written


def test_a_stopped_experiment_refuses_observations(uow):
    from service.controller import experiments

    create(uow, "feed")
    experiments.set_status(uow, "feed", "stopped")
    with pytest.raises(ApiError) as error:
        observe(uow, "feed", [observation(0)])
    assert (error.value.status, error.value.code) == (409, "conflict")


def test_a_statistics_batch_is_applied_once_per_id_and_content(uow):
    create(uow, "feed")
    body = {"batch_id": "job/1", "cells": [
        {"round": 0, "arm": "a", "metric": "x", "count": 4, "sum": 2.0, "sum_of_squares": 3.0},
        {"round": 0, "arm": "b", "metric": "x", "count": 2, "sum": -1.0, "sum_of_squares": 1.0}],
        "units": [{"round": 0, "arm": "a", "units": 3}]}
    applied = push_statistics(uow, "feed", body)
    assert (applied.duplicate, applied.cells, applied.units, applied.late_cells) == (False, 2, 1, 0)
    assert push_statistics(uow, "feed", body).duplicate is True
    changed = dict(body, cells=body["cells"][:1])
    with pytest.raises(ApiError) as error:
        push_statistics(uow, "feed", changed)
    assert error.value.status == 409
    history = reports.round_history(uow, "feed", 0, None)
    assert history.counts[0].tolist() == [4, 2] and history.units[0].tolist() == [3, 0]
    assert history.means[0, 0].tolist() == [0.5, -0.5]
