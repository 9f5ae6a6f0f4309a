"""The per-process experiment cache: a new version reloads the experiment but reuses its arms."""

from __future__ import annotations

import sqlalchemy as sa

from service.bootstrap import get_uow
from service.db import get_db


def test_a_new_version_reuses_the_arms_of_the_same_experiment(app, api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    cache = get_uow(app).cache
    with app.app_context():
        before = cache.get("setup-a", fresh=True)
        assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200
        after = cache.get("setup-a", fresh=True)
    assert after.version > before.version and after.round_index == before.round_index + 1
    assert after.arm_params is before.arm_params and after.arm_names is before.arm_names
    assert after.arm_positions == {"a": 0, "b": 1}


def test_an_experiment_recreated_under_the_same_name_gets_its_own_arms(app, api, setup_a):
    """Deleted out of band (there is no API for it) and created again: SQLite may give the new row the
    old id; once its version moves on, the creation time tells the two apart."""
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    cache = get_uow(app).cache
    with app.app_context():
        old = cache.get("setup-a", fresh=True)
    with get_db(app).write() as session:
        session.execute(sa.text("DELETE FROM experiments WHERE name = 'setup-a'"))
    arms = [{"name": "c", "params": {"weight": 2.0}}, {"name": "d"}, {"name": "e"}]
    assert api("POST", "/api/v1/experiments", json=setup_a(arms=arms)).status_code == 201
    assert api("POST", "/api/v1/experiments/setup-a/rounds").status_code == 200  # version 2
    with app.app_context():
        new = cache.get("setup-a", fresh=True)
    assert new.id == old.id  # the case the creation time is there for
    assert new.arm_names == ("c", "d", "e") and new.arm_params == ({"weight": 2.0}, {}, {})
    assert new.arm_positions == {"c": 0, "d": 1, "e": 2}
    assert old.arm_names == ("a", "b")
    assignment = api("POST", "/api/v1/experiments/setup-a/assign", role="ingest", json={"unit": "u"}).get_json()
    assert assignment["arm"] in ("c", "d", "e")
