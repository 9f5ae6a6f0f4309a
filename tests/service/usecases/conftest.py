"""The use cases (``service.controller``) run against a real store, without Flask: no application
object, no server, no test client. A :class:`service.store.UnitOfWork` over a migrated SQLite file (a copy
of the migrated template, ``tests.migrated``) or, for tests marked ``postgres``, a fresh PostgreSQL
database; the use cases are called as the routes and the scheduler call them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from service.controller import experiments, ingestion, statistics
from service.db import open_database
from service.schemas import ExperimentCreate, ObservationBatch, StatisticsBatch
from service.store import UnitOfWork
from tests.migrated import upgrade_to_head

from ..conftest import setup_a_body


@pytest.fixture(autouse=True)
def no_application(monkeypatch):
    """Every test here runs without a Flask application: making one fails the test."""
    import flask

    def refuse(*args, **kwargs):
        raise AssertionError("A use-case test made a Flask application; the use cases take a UnitOfWork.")

    monkeypatch.setattr(flask.Flask, "__init__", refuse)


def open_uow(url: str) -> UnitOfWork:
    upgrade_to_head(url)
    return UnitOfWork.open(open_database(url))


@pytest.fixture
def uow(tmp_path) -> Iterator[UnitOfWork]:
    """A unit of work over a migrated SQLite file."""
    opened = open_uow(f"sqlite:///{tmp_path / 'pasto.sqlite'}")
    yield opened
    opened.database.engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend_uow(request, tmp_path) -> Iterator[UnitOfWork]:
    """A unit of work over a migrated database of each backend."""
    url = request.getfixturevalue("postgres_url") if request.param == "postgres" else \
        f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    opened = open_uow(url)
    yield opened
    opened.database.engine.dispose()


def create(uow: UnitOfWork, name: str = "setup-a", **overrides: Any):
    """``experiments.create`` with the paper's setup A (``tests/service/conftest.setup_a_body``)."""
    return experiments.create(uow, ExperimentCreate.model_validate(setup_a_body(name, **overrides)))


def observe(uow: UnitOfWork, name: str, observations: list[dict[str, Any]]):
    """What ``POST .../observations`` does with a body: open the experiment, then ingest."""
    snapshot = ingestion.open_experiment(uow, name)
    return ingestion.ingest(uow, snapshot, ObservationBatch.model_validate({"observations": observations}).observations)


def push_statistics(uow: UnitOfWork, name: str, body: dict[str, Any]):
    """What ``POST .../statistics`` does with a body."""
    snapshot = ingestion.open_experiment(uow, name)
    return statistics.ingest_statistics(uow, snapshot, StatisticsBatch.model_validate(body))


@pytest.fixture
def setup_a() -> Callable[..., dict[str, Any]]:
    return setup_a_body
