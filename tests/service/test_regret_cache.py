"""The diagnostics' regret per round comes from this process's cache of the round summaries
(``reports.stored_regrets``): after every close, and when a summary arrives late for an earlier round,
it equals what reading every round's summary gives (the oracle, the read it replaced)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from service import store
from service.controller import reports
from service.db import get_db
from service.models import Experiment, Round
from service.responses import RoundSummary
from service.store import UnitOfWork
from tests.service.test_rounds import EXPERIMENT, experiment_row, observe


def oracle(app) -> list:
    """The regret of every round with a summary, in round order, from every stored summary."""
    with get_db(app).read() as session:
        return [summary.get("regret") for summary in session.execute(
            sa.select(Round.summary).where(Round.experiment_id == experiment_row(app).id).order_by(Round.index)
        ).scalars() if summary is not None]


def per_round(api) -> list:
    answer = api("GET", f"{EXPERIMENT}/diagnostics", role="read")
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()["regret"]["per_round"]


@pytest.mark.parametrize("in_list", [1, 100])  # 1: a second new summary is read with every summary
def test_regret_per_round_follows_new_and_late_summaries(api, app, setup_a, monkeypatch, in_list):
    monkeypatch.setattr(reports, "_REGRET_IN_LIST", in_list)
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    assert per_round(api) == [] == oracle(app)
    for index in range(3):
        observe(api, index, f"r{index}-")
        assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
        assert per_round(api) == oracle(app) and len(oracle(app)) == index + 1
    identifier = experiment_row(app).id
    with get_db(app).write() as session:  # rounds 1 and 2 as if their summaries were not written yet
        kept = dict(session.execute(sa.select(Round.index, Round.summary).where(
            Round.experiment_id == identifier, Round.index >= 1, Round.summary.is_not(None))).all())
        session.execute(sa.update(Round).where(Round.experiment_id == identifier, Round.index >= 1)
                        .values(summary=sa.null()))  # SQL NULL, as a round has before its summary
    reports._regret_caches.clear()  # a process that has not seen them
    assert per_round(api) == oracle(app) and len(oracle(app)) == 1
    observe(api, 3, "r3-")
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    assert per_round(api) == oracle(app) and len(oracle(app)) == 2  # rounds 0 and 3
    store.store_summaries(get_db(app), identifier, [(index, RoundSummary.load(summary))
                                                    for index, summary in sorted(kept.items())])  # the late summaries arrive
    expected = oracle(app)
    assert len(expected) == 4 and expected[1:3] == [kept[1]["regret"], kept[2]["regret"]]
    assert per_round(api) == expected


def cached_ids(app) -> tuple[set, set]:
    """The experiment ids in this process's regret and optimum caches of the app's database."""
    engine = get_db(app).engine
    return set(reports._regret_caches[engine].entries), set(reports._optimum_caches[engine].entries)


def delete_experiment(api, path: str) -> None:
    """Stop, archive and delete the experiment at ``path`` (deleting needs it archived)."""
    for step in ("stop", "archive"):
        assert api("POST", f"{path}/{step}").status_code == 200, step
    assert api("DELETE", path).status_code == 200


def test_the_caches_forget_a_deleted_experiment_when_another_one_is_added(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    observe(api, 0, "r0-")
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    per_round(api)
    first = experiment_row(app).id
    assert cached_ids(app) == ({first}, {first})
    delete_experiment(api, EXPERIMENT)
    assert cached_ids(app) == ({first}, {first})  # nothing reads them again, nothing removes them yet
    assert api("POST", "/api/v1/experiments", json=setup_a(name="setup-b")).status_code == 201
    assert api("GET", "/api/v1/experiments/setup-b/diagnostics", role="read").status_code == 200
    second = experiment_row_named(app, "setup-b")
    assert cached_ids(app) == ({second}, {second})
    # An experiment that still exists keeps its entries when another one is added.
    assert api("POST", "/api/v1/experiments", json=setup_a(name="setup-c")).status_code == 201
    assert api("GET", "/api/v1/experiments/setup-c/diagnostics", role="read").status_code == 200
    third = experiment_row_named(app, "setup-c")
    assert cached_ids(app) == ({second, third}, {second, third})


def experiment_row_named(app, name: str) -> int:
    with get_db(app).read() as session:
        return session.execute(sa.select(Experiment.id).where(Experiment.name == name)).scalar_one()


def test_a_delete_between_the_two_regret_reads_is_not_seen(backend_api, setup_a, monkeypatch):
    """The delete is committed after ``summarized_rounds`` listed the summaries and before
    ``round_regrets`` reads them, in the same read session: the read transaction keeps its snapshot
    (SQLite's deferred transaction; PostgreSQL's read sessions at REPEATABLE READ, ``service.db``) and
    reads the regrets as they were, on both backends (at READ COMMITTED PostgreSQL saw the delete and
    the summaries were gone: once a KeyError, then a 404)."""
    api = backend_api
    app = api.client.application
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    for index in range(2):
        observe(api, index, f"r{index}-")
        assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    before = oracle(app)
    identifier = experiment_row(app).id
    reports._regret_caches.clear()  # a process that has read none of them
    read_regrets = store.round_regrets

    def delete_then_read(*args, **kwargs):
        delete_experiment(api, EXPERIMENT)  # another connection, committed
        return read_regrets(*args, **kwargs)

    monkeypatch.setattr(store, "round_regrets", delete_then_read)
    database = get_db(app)
    with database.read() as session:
        assert reports.stored_regrets(UnitOfWork.open(database), session, identifier, "setup-a") == before
