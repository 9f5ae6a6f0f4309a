"""Round closing: compare-and-set (one update per round), settle time, pause, crash safety, scheduler job."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import sqlalchemy as sa

import pasto.algorithm
from pasto.algorithm import AlgorithmConfig
from service import store
from service.controller.rounds import close_due_rounds, close_round
from service.bootstrap import get_uow
from service.db import get_db
from service.models import Experiment, Round
from service.scheduler import run_scheduled_work

EXPERIMENT = "/api/v1/experiments/setup-a"


def observe(api, round_index: int, prefix: str, n: int = 40) -> None:
    batch = [{"id": f"{prefix}{i}", "unit": f"{prefix}{i}", "round": round_index,
              "values": {"x": 1.0 if i % 2 else -1.0, "y": 0.5}} for i in range(n)]
    response = api("POST", f"{EXPERIMENT}/observations", role="ingest", json={"observations": batch})
    assert response.status_code == 202, response.get_json()


def experiment_row(app):
    with get_db(app).read() as session:
        return session.execute(sa.select(Experiment).where(Experiment.name == "setup-a")).scalar_one()


def round_rows(app):
    with get_db(app).read() as session:
        return session.execute(sa.select(Round).order_by(Round.index)).scalars().all()


def count_updates(monkeypatch) -> list[int]:
    calls: list[int] = []
    real_update = pasto.algorithm.update

    def counting_update(*args, **kwargs):
        calls.append(1)
        return real_update(*args, **kwargs)

    monkeypatch.setattr("service.controller.rounds.update", counting_update)
    return calls


def test_two_threads_closing_the_same_round_apply_one_update(backend_api, setup_a, monkeypatch):
    api = backend_api
    app = api.client.application
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    observe(api, 0, "a")
    experiment_id = experiment_row(app).id
    calls = count_updates(monkeypatch)
    barrier = threading.Barrier(2)
    results = []

    def closer():
        barrier.wait()
        results.append(close_round(get_uow(app), experiment_id, 0))

    threads = [threading.Thread(target=closer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        # Hang guard, not a tolerance: the racing closes take milliseconds.
        thread.join(timeout=60)
    assert sorted(result is None for result in results) == [False, True]
    assert len(calls) == 1
    experiment = experiment_row(app)
    assert (experiment.round_index, experiment.applied_rounds) == (1, 1)
    assert [row.index for row in round_rows(app)] == [0, 1]


def test_two_schedulers_close_each_round_once(backend_api, setup_a, monkeypatch):
    api = backend_api
    app = api.client.application
    assert api("POST", "/api/v1/experiments", json=setup_a(round_seconds=1)).status_code == 201
    calls = count_updates(monkeypatch)
    start = experiment_row(app).created_at
    for step in range(1, 6):
        now = start + timedelta(seconds=2 * step)
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=lambda b=barrier, t=now: (b.wait(), close_due_rounds(get_uow(app), t)))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert len(calls) == 5
    assert experiment_row(app).round_index == 5
    assert [row.index for row in round_rows(app)] == list(range(6))


def test_a_failed_update_leaves_the_round_open(api, app, setup_a, monkeypatch):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    observe(api, 0, "a")
    before = experiment_row(app)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash in the middle of the update")

    monkeypatch.setattr("service.controller.rounds.update", crash)
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 500
    after = experiment_row(app)
    assert (after.round_index, after.applied_rounds, after.version, after.state) == (
        before.round_index, before.applied_rounds, before.version, before.state)
    assert [row.closed_at for row in round_rows(app)] == [None]
    monkeypatch.undo()
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    assert experiment_row(app).applied_rounds == 1


def test_scheduler_job_closes_due_rounds_only(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a(round_seconds=60)).status_code == 201
    ends_at = round_rows(app)[0].ends_at
    assert close_due_rounds(get_uow(app), ends_at - timedelta(seconds=1)) == []
    advances = close_due_rounds(get_uow(app), ends_at)
    assert [(a.experiment, a.closed_round, a.applied, a.round_index) for a in advances] == [("setup-a", 0, (0,), 1)]
    rounds = round_rows(app)
    assert rounds[1].started_at == ends_at and rounds[1].ends_at == ends_at + timedelta(seconds=60)
    assert close_due_rounds(get_uow(app), ends_at) == []


def test_settle_time_delays_the_update_and_decides_lateness(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a(round_seconds=60, settle_seconds=30)).status_code == 201
    observe(api, 0, "a")
    ends_at = round_rows(app)[0].ends_at
    first = close_due_rounds(get_uow(app), ends_at + timedelta(seconds=1))
    assert [(a.closed_round, a.applied) for a in first] == [(0, ())]
    rounds = round_rows(app)
    assert rounds[1].probabilities == rounds[0].probabilities  # nothing learned yet
    assert rounds[0].closed_at is not None and rounds[0].applied_at is None
    observe(api, 0, "settling", n=6)  # round 0 has ended but is settling: on time
    assert api("GET", f"{EXPERIMENT}/diagnostics", role="read").get_json()["late_observations"] == 0
    second = close_due_rounds(get_uow(app), ends_at + timedelta(seconds=31))
    assert [(a.closed_round, a.applied) for a in second] == [(None, (0,))]
    experiment = experiment_row(app)
    assert (experiment.round_index, experiment.applied_rounds) == (1, 1)
    observe(api, 0, "late", n=3)
    assert api("GET", f"{EXPERIMENT}/diagnostics", role="read").get_json()["late_observations"] == 3


def test_manual_close_ignores_the_settle_time(api, app, setup_a):
    from pasto.hashing import bucket, choose_arm, cumulative_probabilities

    assert api("POST", "/api/v1/experiments", json=setup_a(settle_seconds=3600)).status_code == 201
    # Each unit's values are its round-0 arm's setup-A means (a: x 2, y -2; b: x 0, y 2): data that
    # tell the arms apart, so the closed round moves the mixture off the uniform start.
    truth = ((2.0, -2.0), (0.0, 2.0))
    batch = []
    for i in range(40):
        x, y = truth[choose_arm(cumulative_probabilities([0.5, 0.5]), bucket(7, f"a{i}", 0))]
        batch.append({"id": f"a{i}", "unit": f"a{i}", "round": 0,
                      "values": {"x": x + 0.1 * (i % 3 - 1), "y": y + 0.1 * (i % 5 - 2)}})
    assert api("POST", f"{EXPERIMENT}/observations", role="ingest", json={"observations": batch}).status_code == 202
    closed = api("POST", f"{EXPERIMENT}/rounds").get_json()
    assert closed["closed_round"] == 0 and closed["applied"] == [0]
    assert closed["round"]["index"] == 1
    assert closed["probabilities"] != [0.5, 0.5]


def test_a_round_closed_early_by_hand_ends_when_it_closed(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a(round_seconds=3600)).status_code == 201
    planned_end = round_rows(app)[0].ends_at
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    first, second = round_rows(app)
    assert first.ends_at == first.closed_at == second.started_at < planned_end
    history = api("GET", f"{EXPERIMENT}/rounds", role="read").get_json()["rounds"]
    assert history[0]["ends_at"] == history[0]["closed_at"] == history[1]["started_at"]


def test_paused_rounds_do_not_advance_and_resume_restarts_the_clock(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a(round_seconds=60)).status_code == 201
    ends_at = round_rows(app)[0].ends_at
    assert api("POST", f"{EXPERIMENT}/pause").get_json()["status"] == "paused"
    assert close_due_rounds(get_uow(app), ends_at + timedelta(hours=1)) == []
    assert api("POST", f"{EXPERIMENT}/assign", role="ingest", json={"unit": "u"}).get_json()["round"] == 0
    observe(api, 0, "while-paused")  # paused experiments keep collecting data
    resumed = api("POST", f"{EXPERIMENT}/resume").get_json()
    assert resumed["status"] == "running"
    assert round_rows(app)[0].ends_at > ends_at


def test_stopped_experiments_are_never_advanced(api, app, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a(round_seconds=60)).status_code == 201
    api("POST", f"{EXPERIMENT}/stop")
    assert close_due_rounds(get_uow(app), round_rows(app)[0].ends_at + timedelta(hours=1)) == []
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 409


def test_scheduler_tick_writes_a_heartbeat(api, app):
    assert api("GET", "/healthz", role=None).get_json()["scheduler"]["alive"] is False
    run_scheduled_work(app, "test-scheduler")
    health = api("GET", "/healthz", role=None).get_json()
    assert health["scheduler"]["alive"] is True
    assert health["database"]["reachable"] is True
    assert health["schema"]["current"] == health["schema"]["head"]


def test_get_rounds_reports_every_round(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    for index in range(3):
        observe(api, index, f"r{index}-")
        assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    rounds = api("GET", f"{EXPERIMENT}/rounds", role="read").get_json()["rounds"]
    assert [entry["index"] for entry in rounds] == [0, 1, 2, 3]
    for entry in rounds[:3]:
        assert entry["closed_at"] is not None
        assert sum(entry["counts"]) == 40
        assert len(entry["probabilities"]) == 2 and abs(sum(entry["probabilities"]) - 1) < 1e-12
        assert set(entry["means"]) == {"x", "y"}
        assert isinstance(entry["objective"], float) and isinstance(entry["regret"], float)
        assert entry["regret"] >= 0
    assert rounds[3]["closed_at"] is None and rounds[3]["objective"] is None
    diagnostics = api("GET", f"{EXPERIMENT}/diagnostics", role="read").get_json()
    assert set(diagnostics) >= {"objective", "best_mixture", "best_single", "regret", "guardrails", "srm",
                                "late_observations"}
    assert len(diagnostics["regret"]["per_round"]) == 3
    assert diagnostics["regret"]["cumulative"] == pytest.approx(sum(diagnostics["regret"]["per_round"]))
    assert diagnostics["guardrails"][0]["metric"] == "y"
    assert set(diagnostics["srm"]) >= {"statistic", "p_value", "ok"}


@pytest.mark.parametrize("algorithm", [{"preset": "paper"}, {"preset": "default", "serving": "exploration", "solve_every": 1},
                                       {"preset": "default", "estimator": "control_variate"}])
def test_presets_and_overrides_run_through_the_service(api, setup_a, algorithm):
    created = api("POST", "/api/v1/experiments", json=setup_a(algorithm=algorithm))
    assert created.status_code == 201, created.get_json()
    # What the experiment stores (and shows) is exactly the configuration it runs: the preset resolved.
    overrides = {key: value for key, value in algorithm.items() if key != "preset"}
    assert created.get_json()["algorithm"] == AlgorithmConfig.from_preset(algorithm["preset"], **overrides).to_dict()
    for index in range(4):
        observe(api, index, f"r{index}-")
        closed = api("POST", f"{EXPERIMENT}/rounds")
        assert closed.status_code == 200, closed.get_json()
        probabilities = closed.get_json()["probabilities"]
        assert abs(sum(probabilities) - 1) < 1e-12 and min(probabilities) >= 0
        # The paper preset's exploration floor eps_t / K keeps every arm served; safe serving has no
        # floor (an exact solve serves an arm the data rule out nothing).
        if algorithm["preset"] == "paper":
            assert min(probabilities) > 0
    assert api("GET", f"{EXPERIMENT}/diagnostics", role="read").status_code == 200


def test_rounds_can_be_read_page_by_page(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    for index in range(5):
        observe(api, index, f"r{index}-", n=10)
        assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    everything = api("GET", f"{EXPERIMENT}/rounds", role="read").get_json()["rounds"]
    assert [entry["index"] for entry in everything] == [0, 1, 2, 3, 4, 5]
    page = api("GET", f"{EXPERIMENT}/rounds?since=2&limit=2", role="read").get_json()["rounds"]
    assert page == everything[2:4]
    assert api("GET", f"{EXPERIMENT}/rounds?since=4", role="read").get_json()["rounds"] == everything[4:]
    assert api("GET", f"{EXPERIMENT}/rounds?since=99", role="read").get_json()["rounds"] == []
    for query, location in (("since=-1", "since"), ("limit=0", "limit"), ("since=x", "since")):
        response = api("GET", f"{EXPERIMENT}/rounds?{query}", role="read")
        assert response.status_code == 422
        assert response.get_json()["error"]["details"][0]["location"] == location


def test_the_history_is_paged_by_default_with_a_cursor(app, api, setup_a, serve, admin_token, monkeypatch):
    """Without ``limit`` a page holds PAGE_ARM_ROUNDS / K rounds (here 6 / 2 = 3); ``next_since``
    leads through every round to the current one, and the client follows it."""
    from pasto_client import Client
    from service.routes import rounds as rounds_route

    monkeypatch.setattr(rounds_route, "PAGE_ARM_ROUNDS", 6)
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    for index in range(7):
        observe(api, index, f"r{index}-", n=10)
        assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    everything = api("GET", f"{EXPERIMENT}/rounds?limit=100", role="read").get_json()
    assert [entry["index"] for entry in everything["rounds"]] == list(range(8))
    assert everything["next_since"] is None

    pages, since = [], 0
    while since is not None:
        page = api("GET", f"{EXPERIMENT}/rounds?since={since}", role="read").get_json()
        pages.append([entry["index"] for entry in page["rounds"]])
        since = page["next_since"]
    assert pages == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert api("GET", f"{EXPERIMENT}/rounds?since=2&limit=2", role="read").get_json()["next_since"] == 4
    assert api("GET", f"{EXPERIMENT}/rounds?since=99", role="read").get_json() == {"rounds": [], "next_since": None,
                                                                                 "source_error": None}

    with Client(serve(app), admin_token) as client:
        assert client.rounds("setup-a") == everything["rounds"]
        assert client.rounds("setup-a", since=5) == everything["rounds"][5:]
        assert client.rounds("setup-a", since=1, limit=2) == everything["rounds"][1:3]


def test_default_page_size_bounds_the_cells_of_a_page():
    from service.routes.rounds import default_page_rounds

    assert default_page_rounds(2) == 1000
    assert default_page_rounds(10_000) == 20
    assert default_page_rounds(300_000) == 1


@pytest.mark.parametrize("segmented", [False, True], ids=["unsegmented", "open-set"])
def test_a_summary_lost_after_the_close_is_repaired_at_the_next_tick(backend_api, setup_a, monkeypatch, segmented):
    """The close commits, then the summary's write fails (a crash, a locked SQLite): the round keeps
    what its summary is computed from, and the next tick stores the very summary the close would have.
    The last applied round's input only refers to the experiment (its state and totals are the round's
    until the next update); the next close writes it in full before its update changes them. With an
    open set of segments, a value gets its own segment in between."""
    api = backend_api
    app = api.client.application
    for name in ("lost", "kept"):
        body = setup_a(name=name, round_seconds=60)
        if segmented:
            body["objective"] = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]}
            body.update(segments={"by": "country", "min_units": 10, "max_segments": 4}, algorithm={"preset": "paper"})
        created = api("POST", "/api/v1/experiments", json=body)
        assert created.status_code == 201, created.get_json()
    lost_id, kept_id = experiment_row_named(app, "lost").id, experiment_row_named(app, "kept").id
    real_store = store.store_summaries

    def failing_store(database, experiment_id, summaries):
        if experiment_id == lost_id:
            raise sa.exc.OperationalError("UPDATE rounds", {}, Exception("database is locked"))
        return real_store(database, experiment_id, summaries)

    for round_index in range(3):
        for name in ("lost", "kept"):
            batch = [{"id": f"{name}{round_index}-{i}", "unit": f"u{round_index}-{i}", "round": round_index,
                      "values": {"x": 1.0 if i % 3 else -1.0, "y": 0.5 - (i % 2)}} for i in range(40)]
            if segmented:
                for i, observation in enumerate(batch):
                    observation["segment"] = ["fr", "de", "jp"][i % 3] if round_index else ["fr", "de"][i % 2]
            response = api("POST", f"/api/v1/experiments/{name}/observations", role="ingest",
                           json={"observations": batch})
            assert response.status_code == 202, response.get_json()
        with monkeypatch.context() as patch:
            patch.setattr(store, "store_summaries", failing_store)
            advances = close_due_rounds(get_uow(app), max(row.ends_at for row in round_rows(app)))
        assert sorted(advance.experiment for advance in advances) == ["kept", "lost"]
        with get_db(app).read() as session:
            inputs = {index: data for index, data in session.execute(
                sa.select(Round.index, Round.summary_input).where(Round.experiment_id == lost_id)) if data is not None}
        # Only the last applied round refers to the experiment; the earlier ones were kept in full.
        assert sorted(inputs) == list(range(round_index + 1)), inputs
        assert inputs[round_index] == {"from_experiment": {"applied_rounds": round_index + 1}}
        assert all({"state", "pooled", "propensities"} <= set(inputs[index]) for index in range(round_index))
        assert all(("segment_state" in inputs[index]) == segmented for index in range(round_index))
    with get_db(app).read() as session:
        summaries = dict(session.execute(sa.select(Round.experiment_id, sa.func.count(Round.summary))
                                         .group_by(Round.experiment_id)).all())
    assert summaries[lost_id] == 0 and summaries[kept_id] == 3
    # The next tick, a few seconds later, repairs all three; nothing else changes.
    last_applied = max(row.applied_at for row in round_rows(app) if row.applied_at is not None)
    assert close_due_rounds(get_uow(app), last_applied + timedelta(seconds=3)) == []
    with get_db(app).read() as session:
        rows = session.execute(sa.select(Round.experiment_id, Round.index, Round.summary, Round.summary_input)
                               .where(Round.applied_at.is_not(None))
                               .order_by(Round.experiment_id, Round.index)).all()
    lost = [row.summary for row in rows if row.experiment_id == lost_id]
    kept = [row.summary for row in rows if row.experiment_id == kept_id]
    assert len(lost) == len(kept) == 3 and lost == kept
    assert all(row.summary_input is None for row in rows)
    diagnostics = [api("GET", f"/api/v1/experiments/{name}/diagnostics").get_json() for name in ("lost", "kept")]
    assert len(diagnostics[0]["regret"]["per_round"]) == 3  # cumulative regret counts every round
    assert diagnostics[0]["regret"] == diagnostics[1]["regret"]


def experiment_row_named(app, name: str):
    with get_db(app).read() as session:
        return session.execute(sa.select(Experiment).where(Experiment.name == name)).scalar_one()


def test_healthz_is_degraded_once_the_scheduler_stops_beating(api, app, monkeypatch):
    import service.controller.reports as reports_controller
    from service.models import utcnow

    client = api.client
    health = client.get("/healthz").get_json()
    assert health["status"] == "ok" and health["scheduler"]["alive"] is False  # no scheduler ever ran
    run_scheduled_work(app, "test-scheduler")
    health = client.get("/healthz").get_json()
    assert health["status"] == "ok" and health["scheduler"]["alive"] is True
    later = utcnow() + timedelta(seconds=60)  # well past max(3 x interval, 5 s) without a tick
    monkeypatch.setattr(reports_controller, "utcnow", lambda: later)
    health = client.get("/healthz").get_json()
    assert health["status"] == "degraded" and health["scheduler"]["alive"] is False
