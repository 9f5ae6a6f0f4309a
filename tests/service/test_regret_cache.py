"""The diagnostics' regret per round comes from this process's cache of the round summaries
(``reports.stored_regrets``): after every close, and when a summary arrives late for an earlier round,
it equals what reading every round's summary gives (the oracle, the read it replaced)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from service import store
from service.controller import reports
from service.db import get_db
from service.models import Round
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
    store.store_summaries(get_db(app), identifier, sorted(kept.items()))  # the late summaries arrive
    expected = oracle(app)
    assert len(expected) == 4 and expected[1:3] == [kept[1]["regret"], kept[2]["regret"]]
    assert per_round(api) == expected
