"""Assignment and ingestion (``service.controller.assignment``, ``ingestion``, ``statistics``) against a
real store: the sticky arm, exactly-once counting, all-or-nothing batches."""

from __future__ import annotations

import numpy as np
import pytest
import sqlalchemy as sa

from pasto.hashing import bucket, choose_arm, cumulative_probabilities
from service.controller import assignment, reports, rounds
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


def test_a_segmented_experiment_stores_each_cell_once_and_reads_the_sums_over_segments(backend_uow):
    """The same statistics pushed per segment to a segmented experiment and summed over segments to an
    unsegmented one: the segmented one stores one row per (round, segment, arm, metric) cell and nothing
    summed, and reads back what the unsegmented one does (round history, pooled statistics through a close
    and late cells), exactly (the sums are multiples of 1/4)."""
    from pasto.segments import pool_segments
    from service import store

    uow = backend_uow
    create(uow, "plain")
    create(uow, "seg", objective={"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
           segments={"names": ["new", "returning", "mobile"], "shares": [0.5, 0.3, 0.2]})
    rng = np.random.default_rng(30)

    keys: set[tuple] = set()

    def push(round_index: int, batch: str) -> None:
        cells = []
        for segment in ("new", "returning", "mobile"):
            for arm in ("a", "b"):
                for metric in ("x", "y"):
                    if rng.random() < 0.8:
                        total = float(rng.integers(-40, 40)) / 4
                        cells.append({"round": round_index, "arm": arm, "metric": metric, "segment": segment,
                                      "count": 1, "sum": total, "sum_of_squares": total ** 2})
                        keys.add((round_index, segment, arm, metric))
        summed: dict[tuple, list] = {}
        for cell in cells:
            sums = summed.setdefault((cell["arm"], cell["metric"]), [0, 0.0, 0.0])
            for position, key in enumerate(("count", "sum", "sum_of_squares")):
                sums[position] += cell[key]
        push_statistics(uow, "seg", {"batch_id": batch, "cells": cells})
        push_statistics(uow, "plain", {"batch_id": batch, "cells": [
            {"round": round_index, "arm": arm, "metric": metric, "count": count, "sum": total,
             "sum_of_squares": squares} for (arm, metric), (count, total, squares) in summed.items()]})

    push(0, "r0")
    push(0, "r0-more")
    rounds.close_current_round(uow, "plain", 0)
    rounds.close_current_round(uow, "seg", 0)
    push(1, "r1")
    push(0, "late")  # round 0 is applied: late cells, per segment
    ids = {name: uow.cache.get(name).id for name in ("plain", "seg")}
    with uow.read() as session:
        plain = store.pooled_statistics(session, ids["plain"], 1, 1, 2, 2)
        segmented = store.pooled_statistics(session, ids["seg"], 1, 3, 2, 2)
        rows = session.execute(sa.text(
            "SELECT segment_index, COUNT(*) FROM round_statistics WHERE experiment_id = :e GROUP BY segment_index "
            "ORDER BY segment_index"), {"e": ids["seg"]}).all()
    assert segmented.shape == (3, 2, 2) and plain.shape == (1, 2, 2)
    for name in ("counts", "sums", "sums_of_squares"):
        assert np.array_equal(getattr(pool_segments(segmented), name), getattr(plain, name)[0]), name
    per_segment = [sum(1 for key in keys if key[1] == segment) for segment in ("new", "returning", "mobile")]
    assert [tuple(row) for row in rows] == list(enumerate(per_segment))  # one row per cell, nothing summed
    plain_history, seg_history = (reports.round_history(uow, name, 0, None) for name in ("plain", "seg"))
    assert np.array_equal(plain_history.means, seg_history.means, equal_nan=True)
    assert np.isfinite(seg_history.means).sum() >= 4 and np.array_equal(plain_history.counts, seg_history.counts)
    rounds.close_current_round(uow, "plain", 1)
    rounds.close_current_round(uow, "seg", 1)
    with uow.read() as session:  # the late cells folded into the totals of both
        late = session.execute(sa.text("SELECT COUNT(*) FROM late_statistics")).scalar_one()
        after = {name: store.pooled_statistics(session, ids[name], 2, shape, 2, 2)
                 for name, shape in (("plain", 1), ("seg", 3))}
    assert late == 0  # and the totals read before the close (late cells and round 1 included) stay the same
    for name in ("counts", "sums", "sums_of_squares"):
        assert np.array_equal(getattr(after["seg"], name), getattr(segmented, name)), name
        assert np.array_equal(getattr(after["plain"], name), getattr(plain, name)), name


def test_a_statistics_batchs_content_hash_is_the_one_stored_before_0017(uow):
    """A batch id applied before migration 0017 is recognised after it: the content hash of a batch is
    computed from the same cells as before (sums over segments for an unsegmented experiment, per segment
    for a segmented one). The digests are those the code before 0017 (commit 18cf30f) stored."""
    import sqlalchemy as sa

    create(uow, "plain")
    create(uow, "seg", objective={"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
           segments={"names": ["new", "returning"], "shares": [0.5, 0.5]})
    cells = [{"round": 0, "arm": "b", "metric": "y", "count": 3, "sum": 1.5, "sum_of_squares": 2.25},
             {"round": 0, "arm": "a", "metric": "x", "count": 2, "sum": 2, "sum_of_squares": 4.5}]
    push_statistics(uow, "plain", {"batch_id": "b", "cells": cells, "units": [{"round": 0, "arm": "a", "units": 2}]})
    push_statistics(uow, "seg", {"batch_id": "b", "cells": [{**cell, "segment": segment} for cell in cells
                                                            for segment in ("returning", "new")]})
    with uow.read() as session:
        stored = dict(session.execute(sa.text(
            "SELECT e.name, b.content_hash FROM statistics_batches b JOIN experiments e ON e.id = b.experiment_id")).all())
    assert stored == {"plain": "402b1598195212ac074e58ae37c678387d6730dd36061def07fa0a6ac7564f9d",
                      "seg": "49164768c65f980cca3713ab09975dc2f065eb976ae562d687adc4e587d1a6c0"}
