"""Closing rounds (``service.controller.rounds``) and what the reports read back
(``service.controller.reports``), against a real store: the scheduler's job and the admin's close."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from pasto.algorithm import AlgorithmConfig, ControllerState, initial_state, round_generator, update
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.optimum import best_mixture
from pasto.segments import pool_segments
from service import store
from service.controller import assignment, experiments, reports, rounds
from service.errors import ApiError

from .conftest import create, observe


def feed_round(uow, name: str, round_index: int, n: int = 40) -> None:
    units = [f"r{round_index}-u{i}" for i in range(n)]
    arms = assignment.assign_many(uow, name, units)[2]
    observe(uow, name, [{"id": f"r{round_index}-o{i}", "unit": unit, "round": round_index,
                           "values": {"x": 2.0 if arms[i] == 0 else 0.0, "y": -2.0 if arms[i] == 0 else 2.0}}
                          for i, unit in enumerate(units)])


def test_the_admins_close_applies_the_update_of_the_round(uow):
    create(uow, "feed")
    feed_round(uow, "feed", 0)
    advance, fresh = rounds.close_current_round(uow, "feed", 0)
    assert (advance.closed_round, advance.applied, advance.round_index) == (0, (0,), 1)
    assert (fresh.round_index, fresh.applied_rounds) == (1, 1) and uow.cache.get("feed") is fresh
    # The state is pasto.algorithm.update's on the round's statistics, with the experiment's generator.
    objective = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 0.0, "penalty": 5.0}]})
    config = AlgorithmConfig()
    with uow.read() as session:
        round_statistics = pool_segments(store.pooled_statistics(session, fresh.id, 0, 1, 2, 2))  # (1, M, K) -> (M, K)
    expected = update(config, objective, initial_state(config, 2, 2, objective=objective), round_statistics,
                      round_statistics, propensities=np.array([0.5, 0.5]), rng=round_generator(7, 1))
    assert np.allclose(fresh.probabilities, expected.probabilities)
    assert np.allclose(ControllerState.from_dict(fresh.state).deployed, expected.deployed)


def test_closing_a_round_that_is_not_current_is_a_409(uow):
    create(uow, "feed")
    rounds.close_current_round(uow, "feed", 0)
    with pytest.raises(ApiError) as error:
        rounds.close_current_round(uow, "feed", 0)
    assert (error.value.status, error.value.code) == (409, "conflict")
    experiments.set_status(uow, "feed", "paused")
    with pytest.raises(ApiError) as error:
        rounds.close_current_round(uow, "feed", None)
    assert error.value.status == 409 and "paused" in error.value.message


def test_the_scheduler_closes_due_rounds_once(uow):
    snapshot = create(uow, "feed", round_seconds=60)
    create(uow, "other", round_seconds=3600)
    feed_round(uow, "feed", 0)
    ends = snapshot.round_ends_at
    assert rounds.close_due_rounds(uow, ends - timedelta(seconds=1)) == []
    (advance,) = rounds.close_due_rounds(uow, ends)
    assert (advance.experiment, advance.applied, advance.round_index) == ("feed", (0,), 1)
    assert rounds.close_due_rounds(uow, ends) == []  # the next round is not due yet
    assert uow.cache.get("other", fresh=True).round_index == 0


def test_diagnostics_and_history_after_closes(uow):
    create(uow, "feed")
    for round_index in range(3):
        feed_round(uow, "feed", round_index)
        rounds.close_current_round(uow, "feed", round_index)
    diagnostics = reports.diagnostics(uow, "feed")
    assert diagnostics.snapshot.round_index == 3 and len(diagnostics.regret_per_round) == 3
    assert all(regret is not None and regret >= 0 for regret in diagnostics.regret_per_round)
    assert int(diagnostics.units.sum()) == 120 and diagnostics.late_observations == 0
    # The estimate: arm a has x = 2, y = -2; arm b has x = 0, y = 2 (setup A).
    assert np.allclose(diagnostics.report.estimate.means, [[2.0, 0.0], [-2.0, 2.0]])
    objective = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 0.0, "penalty": 5.0}]})
    assert diagnostics.report.optimum.best_mixture_value == pytest.approx(
        best_mixture(objective, np.array([[2.0, 0.0], [-2.0, 2.0]]))[1])
    history = reports.round_history(uow, "feed", 0, None)
    assert [row.index for row in history.rounds] == [0, 1, 2, 3]
    assert history.counts.sum(axis=1).tolist() == [40, 40, 40, 0]
    assert [row.summary is not None for row in history.rounds] == [True, True, True, False]
    assert reports.arm_count(uow, "feed") == 2


def test_late_observations_count_as_late_and_enter_the_next_update(uow):
    create(uow, "feed")
    feed_round(uow, "feed", 0)
    rounds.close_current_round(uow, "feed", 0)
    feed_round(uow, "feed", 0, n=50)  # ids r0-o40.. are new; units of round 0, which is applied
    diagnostics = reports.diagnostics(uow, "feed")
    assert diagnostics.late_observations == 10
    with uow.read() as session:
        pooled = store.pooled_statistics(session, diagnostics.snapshot.id, 1, 1, 2, 2)
    assert isinstance(pooled, Statistics) and pooled.shape == (1, 2, 2) and int(pooled.counts[0, 0].sum()) == 50


def test_controller_metrics_and_health_read_the_store(uow):
    create(uow, "feed")
    feed_round(uow, "feed", 0)
    rounds.close_current_round(uow, "feed", 0)
    rounds.record_heartbeat(uow, "test:1", uow.cache.get("feed").updated_at)
    metrics = reports.controller_metrics(uow)
    assert [row.name for row in metrics["experiments"]] == ["feed"]
    assert metrics["stored"] == {uow.cache.get("feed").id: 40} and metrics["last_heartbeat"] is not None
    health = reports.health(uow, timedelta(days=1), timeout=10.0)
    assert health.reachable and health.current == health.head and health.alive


def test_a_close_without_a_metric_source_does_not_look_for_one(uow, monkeypatch):
    """The admin's and the scheduler's closes know the experiment declares no source: no read for it."""
    def no_source_expected(*args, **kwargs):
        raise AssertionError("fetch_due_rounds was called for an experiment without a metric source")

    monkeypatch.setattr(rounds, "fetch_due_rounds", no_source_expected)
    snapshot = create(uow, "feed", round_seconds=60)
    feed_round(uow, "feed", 0)
    assert rounds.close_current_round(uow, "feed", 0)[0].applied == (0,)
    (advance,) = rounds.close_due_rounds(uow, uow.cache.get("feed").round_ends_at)
    assert advance.applied == (1,) and snapshot.round_index == 0
