"""Creating and managing experiments (``service.controller.experiments``) against a real store."""

from __future__ import annotations

import numpy as np
import pytest

from pasto.algorithm import AlgorithmConfig
from service import store
from service.controller import experiments
from service.errors import ApiError
from service.schemas import ExperimentCreate

from .conftest import create


def test_create_stores_the_experiment_and_serves_its_round_0(uow, setup_a):
    snapshot = create(uow, "feed")
    assert (snapshot.name, snapshot.status, snapshot.round_index, snapshot.applied_rounds) == ("feed", "running", 0, 0)
    assert snapshot.arm_names == ("a", "b") and snapshot.metrics == ("x", "y") and snapshot.seed == 7
    assert np.allclose(snapshot.probabilities, [0.5, 0.5]) and snapshot.serving is snapshot.probabilities
    # The stored configuration is the resolved algorithm, no preset key.
    assert snapshot.config["algorithm"] == AlgorithmConfig().to_dict()
    with uow.read() as session:
        assert store.experiment_row_counts(session, snapshot.id)["arms"] == 2
    assert [event.kind for event in experiments.events(uow, "feed", 0, 10)] == ["created"]


def test_a_taken_name_is_a_409_and_changes_nothing(uow):
    first = create(uow, "feed")
    with pytest.raises(ApiError) as error:
        create(uow, "feed", seed=8)
    assert (error.value.status, error.value.code) == (409, "conflict")
    assert experiments.show(uow, "feed").seed == first.seed == 7


def test_an_objective_on_an_unknown_metric_is_a_422_naming_it(uow, setup_a):
    body = setup_a("bad")
    body["objective"] = {"primary": "z"}
    with pytest.raises(ApiError) as error:
        experiments.create(uow, ExperimentCreate.model_validate(body))
    assert error.value.status == 422 and "objective" in str(error.value.details)


def test_status_changes_are_events_and_new_versions(uow):
    created = create(uow, "feed")
    paused = experiments.set_status(uow, "feed", "paused")
    assert paused.status == "paused" and paused.version > created.version
    assert experiments.set_status(uow, "feed", "stopped").status == "stopped"
    with pytest.raises(ApiError) as error:
        experiments.set_status(uow, "feed", "paused")
    assert (error.value.status, error.value.code) == (409, "conflict")  # stopped cannot be paused
    assert [event.kind for event in experiments.events(uow, "feed", 0, 10)] == ["created", "paused", "stopped"]


def test_list_archive_and_delete(uow):
    create(uow, "one")
    create(uow, "two")
    assert [snapshot.name for snapshot in experiments.list_all(uow)] == ["one", "two"]
    with pytest.raises(ApiError) as error:
        experiments.delete(uow, "one")
    assert (error.value.status, error.value.code) == (409, "conflict")  # archive first
    archived = experiments.archive(uow, "one")
    assert archived.status == "stopped" and archived.archived_at is not None
    assert [snapshot.name for snapshot in experiments.list_all(uow)] == ["two"]
    assert [snapshot.name for snapshot in experiments.list_all(uow, archived=True)] == ["one"]
    deleted = experiments.delete(uow, "one")
    assert deleted["experiments"] == 1 and deleted["arms"] == 2
    with pytest.raises(ApiError) as error:
        experiments.show(uow, "one")
    assert error.value.status == 404


def test_no_application_can_be_made_here():
    """The suite's guard (conftest ``no_application``) holds: a use case that needed an app would fail."""
    from service import create_app

    with pytest.raises(AssertionError, match="Flask application"):
        create_app({"PASTO_DATABASE_URL": "sqlite://", "PASTO_CHECK_SCHEMA": False})
