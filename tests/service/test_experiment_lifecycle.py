"""Archive and delete of experiments, on SQLite and PostgreSQL: an archived experiment is stopped,
out of the listing and ``/metrics`` (listable with ``?archived=true``) and still assigns its deployed
mixture; a delete removes every row of it in one transaction, and no experiment id is ever given out
twice (SQLite would reuse the newest one's), so a worker holding a deleted experiment's snapshot
cannot write into a new one."""

from __future__ import annotations

import pytest

from service import store
from service.auth import create_token
from service.db import get_db
from tests.service.conftest import Api

API = "/api/v1/experiments"


@pytest.fixture
def lifecycle(backend_url, app_factory):
    """(app, Api) on a migrated database of each backend."""
    application = app_factory(backend_url)
    with get_db(application).write() as session:
        role_tokens = {role: create_token(session, role, f"test-{role}") for role in ("read", "ingest", "admin")}
    yield application, Api(application.test_client(), role_tokens)
    get_db(application).engine.dispose()


def observations(assignments: list[dict], prefix: str = "o") -> dict:
    return {"observations": [{"id": f"{prefix}{i}", "unit": a["unit"], "round": a["round"], "arm": a["arm"],
                              "values": {"x": float(i), "y": 1.0}} for i, a in enumerate(assignments)]}


def fill(api: Api, name: str, n: int = 20) -> list[dict]:
    """Assign ``n`` units, observe them, close a round (rows in every table); the assignments."""
    assigned = api("POST", f"{API}/{name}/assign", role="ingest",
                   json={"units": [f"u{i}" for i in range(n)]}).get_json()["assignments"]
    assert api("POST", f"{API}/{name}/observations", role="ingest", json=observations(assigned)).status_code == 202
    assert api("POST", f"{API}/{name}/rounds").status_code == 200
    late = observations(assigned, prefix="late")  # for round 0, now applied: late statistics too
    assert api("POST", f"{API}/{name}/observations", role="ingest", json=late).status_code == 202
    return assigned


def experiment_id(app, name: str) -> int:
    with app.app_context():
        from service.bootstrap import get_uow

        return get_uow().cache.get(name, fresh=True).id


def row_counts(app, experiment: int) -> dict[str, int]:
    with get_db(app).read() as session:
        return store.experiment_row_counts(session, experiment)


def test_archive_stops_hides_and_keeps_assigning_the_deployed_mixture(lifecycle, setup_a):
    app, api = lifecycle
    for name in ("kept", "put-away"):
        assert api("POST", API, json=setup_a(name)).status_code == 201
    assigned = fill(api, "put-away")

    assert api("POST", f"{API}/put-away/archive", role="read").status_code == 403
    archived = api("POST", f"{API}/put-away/archive")
    assert archived.status_code == 200, archived.get_json()
    body = archived.get_json()
    assert body["status"] == "stopped" and body["archived_at"] is not None
    assert api("POST", f"{API}/put-away/archive").get_json()["archived_at"] == body["archived_at"]  # idempotent
    kinds = [event["kind"] for event in api("GET", f"{API}/put-away/events", role="read").get_json()["events"]]
    assert kinds == ["created", "stopped"]  # the stop archiving made, once
    assert api("GET", f"{API}/kept", role="read").get_json()["archived_at"] is None

    listed = api("GET", API, role="read").get_json()["experiments"]
    assert [experiment["name"] for experiment in listed] == ["kept"]
    listed = api("GET", f"{API}?archived=true", role="read").get_json()["experiments"]
    assert [experiment["name"] for experiment in listed] == ["put-away"]
    assert [e["name"] for e in api("GET", f"{API}?archived=false", role="read").get_json()["experiments"]] == ["kept"]
    refused = api("GET", f"{API}?archived=yes", role="read")
    assert refused.status_code == 422 and refused.get_json()["error"]["message"].startswith("archived: ")
    assert api("GET", f"{API}/put-away", role="read").status_code == 200  # still readable by name

    one = api("POST", f"{API}/put-away/assign", role="ingest", json={"unit": "u3"})
    assert one.status_code == 200
    assert one.get_json()["probability"] == pytest.approx(body["deployed"][body["arms"].index(
        {"name": one.get_json()["arm"], "params": one.get_json()["params"]})])
    refused = api("POST", f"{API}/put-away/observations", role="ingest", json=observations(assigned, "again"))
    assert refused.status_code == 409
    assert api("POST", f"{API}/put-away/rounds").status_code == 409  # no more rounds

    # The controller state (read from the database) leaves /metrics; this process's event counters
    # of what it served (assignments) stay, as counters do.
    state = [line for line in api("GET", "/metrics").get_data(as_text=True).splitlines()
             if line.startswith(("pasto_round_index", "pasto_experiment_status", "pasto_arm_"))]
    assert any('experiment="kept"' in line for line in state)
    assert not any('experiment="put-away"' in line for line in state), state


def test_delete_removes_every_row_in_one_go_and_only_once_archived(lifecycle, setup_a):
    app, api = lifecycle
    for name in ("kept", "gone"):
        assert api("POST", API, json=setup_a(name)).status_code == 201
        fill(api, name)
    gone, kept = experiment_id(app, "gone"), experiment_id(app, "kept")
    before = row_counts(app, gone)
    for table in ("experiments", "arms", "rounds", "round_statistics", "pooled_arrays", "late_statistics",
                  "arm_round_counts", "observation_ids", "round_units"):
        assert before[table] > 0, (table, before)
    kept_before = row_counts(app, kept)

    refused = api("DELETE", f"{API}/gone")
    assert refused.status_code == 409 and "archive it" in refused.get_json()["error"]["message"]
    assert api("POST", f"{API}/gone/archive").status_code == 200
    before = row_counts(app, gone)  # archiving records a stop among the experiment's events
    assert api("DELETE", f"{API}/gone", role="read").status_code == 403
    deleted = api("DELETE", f"{API}/gone")
    assert deleted.status_code == 200, deleted.get_json()
    assert deleted.get_json() == {"name": "gone", "deleted_rows": before}
    assert set(row_counts(app, gone).values()) == {0}
    assert row_counts(app, kept) == kept_before

    for method, path in (("GET", ""), ("POST", "/assign"), ("GET", "/rounds"), ("DELETE", "")):
        answer = api(method, f"{API}/gone{path}", role="admin", json={"unit": "u"} if method == "POST" else None)
        assert answer.status_code == 404, (method, path, answer.get_json())
    assert api("GET", f"{API}?archived=true", role="read").get_json()["experiments"] == []

    # The name is free again; the new experiment starts empty: the same observation ids are new to it.
    assert api("POST", API, json=setup_a("gone")).status_code == 201
    assert experiment_id(app, "gone") > max(gone, kept)
    assigned = api("POST", f"{API}/gone/assign", role="ingest",
                   json={"units": [f"u{i}" for i in range(20)]}).get_json()["assignments"]
    accepted = api("POST", f"{API}/gone/observations", role="ingest", json=observations(assigned)).get_json()
    assert accepted == {"accepted": 20, "duplicates": 0}


def test_ids_are_never_reused_so_a_stale_worker_cannot_write_into_a_new_experiment(backend_url, app_factory,
                                                                                     setup_a):
    """Two workers on one database. The newest experiment is deleted through the first and created
    again under the same name; the second still holds the deleted one's snapshot (ingestion does not
    re-check the version). SQLite would give the new experiment the deleted one's id (the largest id
    plus one), and the second worker's batch, checked against the old arms and round, would be
    written into it. It gets a 404 instead, stores nothing, and its next batch goes to the new one."""
    first, second = app_factory(backend_url), app_factory(backend_url)
    try:
        with get_db(first).write() as session:
            role_tokens = {role: create_token(session, role, f"test-{role}") for role in ("read", "ingest", "admin")}
        api, stale = Api(first.test_client(), role_tokens), Api(second.test_client(), role_tokens)
        assert api("POST", API, json=setup_a("older")).status_code == 201
        assert api("POST", API, json=setup_a("newest", seed=11)).status_code == 201
        deleted_id = experiment_id(first, "newest")
        assigned = stale("POST", f"{API}/newest/assign", role="ingest",
                         json={"units": [f"u{i}" for i in range(10)]}).get_json()["assignments"]
        assert stale("POST", f"{API}/newest/observations", role="ingest",
                     json=observations(assigned, "before")).status_code == 202  # cached in the second worker

        assert api("POST", f"{API}/newest/archive").status_code == 200
        assert api("DELETE", f"{API}/newest").status_code == 200
        assert api("POST", API, json=setup_a("newest", seed=11)).status_code == 201
        new_id = experiment_id(first, "newest")
        assert new_id != deleted_id and new_id > deleted_id

        late = stale("POST", f"{API}/newest/observations", role="ingest", json=observations(assigned, "after"))
        assert late.status_code == 404, late.get_json()
        assert row_counts(first, new_id)["observation_ids"] == 0
        again = stale("POST", f"{API}/newest/observations", role="ingest", json=observations(assigned, "after"))
        assert again.status_code == 202 and again.get_json() == {"accepted": 10, "duplicates": 0}
        assert row_counts(first, new_id)["observation_ids"] == 10
        assert row_counts(first, deleted_id)["observation_ids"] == 0
    finally:
        get_db(first).engine.dispose()
        get_db(second).engine.dispose()
