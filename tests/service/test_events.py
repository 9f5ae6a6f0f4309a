"""Experiment events: status changes and controller starts are recorded with their round, and served
paged by ``GET /api/v1/experiments/<name>/events``; no event id is given out twice, on either backend."""

from __future__ import annotations

import time

from service.models import utcnow
from service.scheduler import ControllerStart, run_scheduled_work, scheduler_name, start_scheduler

EXPERIMENT = "/api/v1/experiments/setup-a"


def events(api, name: str = "setup-a", query: str = "") -> list[dict]:
    response = api("GET", f"/api/v1/experiments/{name}/events{query}", role="read")
    assert response.status_code == 200, response.get_json()
    return response.get_json()["events"]


def kinds_and_rounds(api, name: str = "setup-a") -> list[tuple[str, int]]:
    return [(event["kind"], event["round"]) for event in events(api, name)]


def test_status_changes_are_recorded_with_their_round(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    assert api("POST", f"{EXPERIMENT}/pause").status_code == 200
    assert api("POST", f"{EXPERIMENT}/pause").status_code == 200  # a no-op records nothing
    assert api("POST", f"{EXPERIMENT}/resume").status_code == 200
    assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    assert api("POST", f"{EXPERIMENT}/stop").status_code == 200
    assert api("POST", f"{EXPERIMENT}/resume").status_code == 409  # refused: nothing recorded
    assert kinds_and_rounds(api) == [("created", 0), ("paused", 1), ("resumed", 1), ("stopped", 2)]
    every = events(api)
    assert [event["id"] for event in every] == sorted(event["id"] for event in every)
    assert all(event["details"] is None and event["at"].endswith("Z") for event in every)
    experiment = api("GET", EXPERIMENT, role="read").get_json()
    assert every[0]["at"] == experiment["created_at"]
    assert every[-1]["at"] == experiment["updated_at"]


def test_events_are_paged_and_checked(api, setup_a):
    for name in ("setup-a", "other"):
        assert api("POST", "/api/v1/experiments", json=setup_a(name)).status_code == 201
    for _ in range(3):
        assert api("POST", f"{EXPERIMENT}/pause").status_code == 200
        assert api("POST", f"{EXPERIMENT}/resume").status_code == 200
    first = api("GET", f"{EXPERIMENT}/events?limit=4", role="read").get_json()
    assert [event["kind"] for event in first["events"]] == ["created", "paused", "resumed", "paused"]
    second = api("GET", f"{EXPERIMENT}/events?limit=4&since={first['next_since']}", role="read").get_json()
    assert [event["kind"] for event in second["events"]] == ["resumed", "paused", "resumed"]
    assert second["next_since"] is None
    assert first["next_since"] == second["events"][0]["id"]
    # Another experiment's events are its own.
    assert kinds_and_rounds(api, "other") == [("created", 0)]
    assert api("GET", "/api/v1/experiments/nope/events", role="read").status_code == 404
    assert api("GET", f"{EXPERIMENT}/events", role=None).status_code == 401
    for query in ("?since=-1", "?limit=0", "?limit=1001", "?since=x"):
        response = api("GET", f"{EXPERIMENT}/events{query}", role="read")
        assert response.status_code == 422, query
        assert response.get_json()["error"]["code"] == "invalid_request"


def test_a_scheduler_start_is_recorded_once_in_the_round_it_happened(api, app, setup_a):
    """A start is recorded by the first tick that reaches the database, before that tick closes a due
    round: the round is the one the experiment was serving when the controller came back."""
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("stopped-one")).status_code == 201
    assert api("POST", "/api/v1/experiments/stopped-one/stop").status_code == 200
    for _ in range(2):
        assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    start = ControllerStart(at=utcnow())
    for _ in range(3):  # three ticks of one process: one start
        run_scheduled_work(app, "host:1", start)
    assert start.recorded
    assert kinds_and_rounds(api)[-1] == ("controller_started", 2)
    assert [kind for kind, _ in kinds_and_rounds(api)].count("controller_started") == 1
    assert events(api)[-1]["details"] == {"scheduler": "host:1"}
    # A stopped experiment is not served by any scheduler: no start is marked on it.
    assert kinds_and_rounds(api, "stopped-one") == [("created", 0), ("stopped", 0)]
    run_scheduled_work(app, "host:1")  # a tick without a start (tests, tools) records none
    assert [kind for kind, _ in kinds_and_rounds(api)].count("controller_started") == 1


def test_each_start_of_a_real_scheduler_is_recorded(api, app, setup_a):
    """``start_scheduler`` (what ``pasto serve`` and ``pasto worker`` run): started, stopped, and
    started again after a round was closed, it records two starts, each in its round."""
    assert api("POST", "/api/v1/experiments", json=setup_a()).status_code == 201

    def starts() -> list[dict]:
        return [event for event in events(api) if event["kind"] == "controller_started"]

    def wait_for_starts(count: int) -> None:
        # The first tick runs at once on the scheduler's thread; 30 s covers a loaded 2-core machine
        # (it takes milliseconds when idle) and only bounds a failing run.
        deadline = time.monotonic() + 30
        while len(starts()) < count:
            assert time.monotonic() < deadline, f"the scheduler recorded {len(starts())} starts, expected {count}"
            time.sleep(0.02)

    for expected in (1, 2):
        scheduler = start_scheduler(app)
        try:
            wait_for_starts(expected)
        finally:
            scheduler.shutdown(wait=True)
        assert api("POST", f"{EXPERIMENT}/rounds").status_code == 200
    assert [event["round"] for event in starts()] == [0, 1]
    assert {event["details"]["scheduler"] for event in starts()} == {scheduler_name()}


def test_event_ids_are_never_reused_after_a_delete(backend_api, setup_a):
    """SQLite would give a new event the largest id present plus one, so the events of a deleted
    experiment that held the newest ones would hand their ids on, and a poller holding a ``since`` for
    a name deleted and created again would miss the new experiment's first events. Every id is new."""
    api = backend_api
    assert api("POST", "/api/v1/experiments", json=setup_a("a")).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("b")).status_code == 201
    assert api("POST", "/api/v1/experiments/b/pause").status_code == 200
    assert api("POST", "/api/v1/experiments/b/archive").status_code == 200  # records a stop
    b_ids = [event["id"] for event in events(api, "b")]
    assert len(b_ids) == 3 and max(b_ids) > max(event["id"] for event in events(api, "a"))
    since = max(b_ids) + 1  # where a poller of "b" is
    assert api("DELETE", "/api/v1/experiments/b").status_code == 200

    assert api("POST", "/api/v1/experiments", json=setup_a("b")).status_code == 201
    assert api("POST", "/api/v1/experiments/b/pause").status_code == 200
    c_events = events(api, "b")
    assert [event["kind"] for event in c_events] == ["created", "paused"]
    assert min(event["id"] for event in c_events) > max(b_ids)
    assert events(api, "b", f"?since={since}") == c_events  # the poller sees the new one from its creation
