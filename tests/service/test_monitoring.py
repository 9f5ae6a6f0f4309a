"""``GET /metrics``: controller gauges agree with the API, event counters count, multiprocess mode
adds up the processes, and the Grafana dashboard only queries metrics the server exports."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from service.controller import reports
from service.controller.rounds import close_due_rounds
from service.bootstrap import get_uow
from service.db import get_db
from service.models import Experiment, Round, utcnow
from service.scheduler import heartbeat

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "dashboards" / "grafana" / "pasto.json"


def scrape(api) -> dict[str, list]:
    """Samples by sample name, from ``GET /metrics`` with a read token (``metrics`` or higher)."""
    response = api("GET", "/metrics", role="read")
    assert response.status_code == 200
    assert response.mimetype == "text/plain"
    assert response.headers["Content-Type"].count("charset") == 1, response.headers["Content-Type"]
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def by_label(samples: list, label: str, **match: str) -> dict[str, float]:
    return {sample.labels[label]: sample.value for sample in samples
            if all(sample.labels.get(key) == value for key, value in match.items())}


def value(samples: dict[str, list], name: str, **match: str) -> float:
    found = [sample.value for sample in samples.get(name, [])
             if all(sample.labels.get(key) == wanted for key, wanted in match.items())]
    assert len(found) == 1, f"{name} {match}: {found}"
    return found[0]


def play_rounds(api, name: str, rounds: int, units: int = 60, first: int = 0) -> dict[str, int]:
    """Assign, observe (setup A means) and close ``rounds`` rounds (unit ids numbered from round
    ``first`` on); returns units assigned per arm."""
    assigned: dict[str, int] = {}
    means = {"a": (2.0, -2.0), "b": (0.0, 2.0)}
    for round_position in range(first, first + rounds):
        units_ids = [f"{name}-r{round_position}-u{i}" for i in range(units)]
        response = api("POST", f"/api/v1/experiments/{name}/assign", role="ingest", json={"units": units_ids})
        assert response.status_code == 200
        batch = []
        for i, assignment in enumerate(response.get_json()["assignments"]):
            assigned[assignment["arm"]] = assigned.get(assignment["arm"], 0) + 1
            x, y = means[assignment["arm"]]
            batch.append({"id": assignment["unit"], "unit": assignment["unit"], "round": assignment["round"],
                          "values": {"x": x + (i % 5 - 2) * 0.3, "y": y + (i % 3 - 1) * 0.3}})
        response = api("POST", f"/api/v1/experiments/{name}/observations", role="ingest",
                       json={"observations": batch})
        assert response.status_code == 202
        assert api("POST", f"/api/v1/experiments/{name}/rounds").status_code == 200
    return assigned


def test_controller_gauges_match_the_api(backend_api, setup_a):
    api = backend_api
    name = "gauges"
    assert api("POST", "/api/v1/experiments", json=setup_a(name)).status_code == 201
    play_rounds(api, name, rounds=4)
    experiment = api("GET", f"/api/v1/experiments/{name}", role="read").get_json()
    rounds = api("GET", f"/api/v1/experiments/{name}/rounds", role="read").get_json()["rounds"]
    diagnostics = api("GET", f"/api/v1/experiments/{name}/diagnostics", role="read").get_json()
    samples = scrape(api)

    arm_names = [arm["name"] for arm in experiment["arms"]]
    probabilities = by_label(samples["pasto_arm_probability"], "arm", experiment=name)
    assert math.isclose(sum(probabilities.values()), 1.0, abs_tol=1e-12)
    assert probabilities == dict(zip(arm_names, experiment["probabilities"]))
    deployed = by_label(samples["pasto_arm_deployed_probability"], "arm", experiment=name)
    assert math.isclose(sum(deployed.values()), 1.0, abs_tol=1e-12)
    assert deployed == dict(zip(arm_names, experiment["deployed"]))

    assert value(samples, "pasto_round_index", experiment=name) == experiment["round"]["index"] == 4
    assert value(samples, "pasto_applied_rounds", experiment=name) == 4
    assert by_label(samples["pasto_experiment_status"], "status", experiment=name) == {
        "running": 1.0, "paused": 0.0, "stopped": 0.0}
    latest = rounds[-2]  # the last applied round; rounds[-1] is being served
    objective = by_label(samples["pasto_objective_estimate"], "mixture", experiment=name)
    assert objective == {"served": latest["objective"], "deployed": latest["objective_deployed"],
                         "best_single": latest["best_single"]["value"], "best_mixture": latest["best_mixture"]}
    assert math.isclose(value(samples, "pasto_regret_cumulative_estimate", experiment=name),
                        diagnostics["regret"]["cumulative"], rel_tol=1e-9)
    (report,) = latest["guardrails"]
    assert value(samples, "pasto_guardrail_margin", experiment=name, metric="y", guardrail="0") == pytest.approx(
        report["estimate"] - report["threshold"], rel=1e-12)
    assert value(samples, "pasto_guardrail_holds", experiment=name, metric="y") == float(report["holds"])
    assert latest["guardrails_served"] == latest["guardrails"]
    for mixture in ("served", "deployed"):
        (mixture_report,) = latest[f"guardrails_{mixture}"]
        assert value(samples, "pasto_guardrail_mixture_holds", experiment=name, metric="y", mixture=mixture,
                     level="estimate") == float(mixture_report["holds"])
        assert value(samples, "pasto_guardrail_mixture_holds", experiment=name, metric="y", mixture=mixture,
                     level="interval") == float(mixture_report["confidently_holds"])
    assert value(samples, "pasto_srm_p_value", experiment=name) == diagnostics["srm"]["p_value"]
    assert value(samples, "pasto_late_observations", experiment=name) == diagnostics["late_observations"] == 0
    assert value(samples, "pasto_observations_stored", experiment=name) == 4 * 60
    assert value(samples, "pasto_scheduler_lag_seconds", experiment=name) == 0.0


def test_event_counters_count_what_the_api_did(api, setup_a):
    name = "events"
    assert api("POST", "/api/v1/experiments", json=setup_a(name)).status_code == 201
    before = scrape(api)
    assigned = play_rounds(api, name, rounds=3, units=50)
    duplicate = [{"id": f"{name}-r0-u0", "unit": f"{name}-r0-u0", "round": 0, "values": {"x": 1.0}}]
    response = api("POST", f"/api/v1/experiments/{name}/observations", role="ingest",
                   json={"observations": duplicate})
    assert response.get_json() == {"accepted": 0, "duplicates": 1}
    samples = scrape(api)

    assert by_label(samples["pasto_assignments_total"], "arm", experiment=name) == assigned
    assert by_label(samples["pasto_observations_total"], "arm", experiment=name) == assigned
    assert value(samples, "pasto_duplicate_observations_total", experiment=name) == 1
    assert value(samples, "pasto_round_updates_total", experiment=name) == 3
    assert value(samples, "pasto_round_update_duration_seconds_count", experiment=name) == 3
    # Manual closes are not scheduler lag.
    assert by_label(samples.get("pasto_round_close_lag_seconds_count", []), "experiment").get(name, 0) == 0

    def requests_to(snapshot, route, method, status):
        return sum(sample.value for sample in snapshot.get("pasto_http_requests_total", [])
                   if sample.labels == {"route": route, "method": method, "status": status})

    assign_route = "/api/v1/experiments/<name>/assign"
    assert requests_to(samples, assign_route, "POST", "200") - requests_to(before, assign_route, "POST", "200") == 3
    assert requests_to(samples, "<unmatched>", "GET", "404") == requests_to(before, "<unmatched>", "GET", "404")
    assert api("GET", "/no/such/page", role=None).status_code == 404
    assert requests_to(scrape(api), "<unmatched>", "GET", "404") == requests_to(samples, "<unmatched>", "GET", "404") + 1


def test_scheduler_lag_and_heartbeat_are_read_from_the_database(api, setup_a):
    # "lagging", not "late": the event counters are per process, and tests/service/test_statistics.py
    # closes rounds of an experiment named "late" in the same process.
    app = api.client.application
    assert api("POST", "/api/v1/experiments", json=setup_a("lagging")).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("idle")).status_code == 201
    assert api("POST", "/api/v1/experiments/idle/pause").status_code == 200
    now = utcnow()
    database = get_db(app)
    with database.write() as session:
        # Both rounds ended 90 s ago and no scheduler closed them.
        session.execute(sa.update(Round).values(ends_at=now - timedelta(seconds=90)))
    heartbeat(get_uow(app), "test-scheduler", now - timedelta(seconds=40))
    samples = scrape(api)
    assert value(samples, "pasto_scheduler_lag_seconds", experiment="lagging") >= 90
    assert value(samples, "pasto_scheduler_lag_seconds", experiment="idle") == 0  # paused: nothing is due
    assert value(samples, "pasto_scheduler_heartbeat_age_seconds") >= 40
    with database.read() as session:
        updated = session.execute(sa.select(Experiment.updated_at).where(Experiment.name == "lagging")).scalar_one()
    assert value(samples, "pasto_last_update_timestamp_seconds", experiment="lagging") == updated.timestamp()

    # The scheduler's job catches up: the lag is recorded once in the histogram and the gauge drops to 0.
    (advance,) = close_due_rounds(get_uow(app))
    assert advance.experiment == "lagging"
    samples = scrape(api)
    assert value(samples, "pasto_scheduler_lag_seconds", experiment="lagging") == 0
    assert value(samples, "pasto_round_close_lag_seconds_count", experiment="lagging") == 1
    assert value(samples, "pasto_round_close_lag_seconds_sum", experiment="lagging") >= 90
    assert value(samples, "pasto_round_updates_total", experiment="lagging") == 1


# One process of a multi-process deployment: assigns units, then optionally serves one scrape.
_WORKER = """
import sys
from service import create_app
database_url, prefix, units, then_scrape = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "scrape"
client = create_app({"PASTO_DATABASE_URL": database_url, "PASTO_ADMIN_TOKEN": "admin"}).test_client()
response = client.post("/api/v1/experiments/shared/assign", headers={"Authorization": "Bearer admin"},
                       json={"units": [f"{prefix}-{i}" for i in range(units)]})
assert response.status_code == 200, response.get_data(as_text=True)
if then_scrape:
    sys.stdout.write(client.get("/metrics", headers={"Authorization": "Bearer admin"}).get_data(as_text=True))
"""


def test_multiprocess_mode_adds_up_every_process(sqlite_url, tmp_path, setup_a):
    import migrations

    migrations.upgrade(sqlite_url)
    from service import create_app

    app = create_app({"PASTO_DATABASE_URL": sqlite_url, "PASTO_ADMIN_TOKEN": "admin"})
    response = app.test_client().post("/api/v1/experiments", headers={"Authorization": "Bearer admin"},
                                      json=setup_a("shared"))
    assert response.status_code == 201
    get_db(app).engine.dispose()

    multiprocess_dir = tmp_path / "prometheus"
    multiprocess_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(multiprocess_dir)}

    def run(*args: str) -> str:
        result = subprocess.run([sys.executable, "-c", _WORKER, sqlite_url, *args], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    run("first", "30", "exit")
    families = {family.name: family for family in text_string_to_metric_families(run("second", "45", "scrape"))}
    assigned = sum(sample.value for sample in families["pasto_assignments"].samples
                   if sample.name == "pasto_assignments_total" and sample.labels["experiment"] == "shared")
    assert assigned == 75  # 30 counted by a process that has exited, 45 by the one scraped
    probabilities = [sample.value for sample in families["pasto_arm_probability"].samples
                     if sample.labels["experiment"] == "shared"]
    assert probabilities == [0.5, 0.5]


# ---------------------------------------------------------------------------------------- Grafana


def _exported_sample_names(text: str) -> set[str]:
    """Every sample name the exposition declares, from the family types (so histograms and counters
    that have not been observed yet still count as exported)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def _panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_grafana_dashboard_is_valid_and_queries_only_exported_metrics(api):
    dashboard = json.loads(GRAFANA.read_text())
    panels = list(_panels(dashboard))
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"

    queries = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    queries.append(variables["experiment"]["query"]["query"])
    exported = _exported_sample_names(api("GET", "/metrics", role="read").get_data(as_text=True))
    referenced = {name for query in queries for name in re.findall(r"\bpasto_[a-z0-9_]+", query)}
    assert referenced, "the dashboard queries no pasto metric"
    assert referenced - exported == set()
    # Every family the server exports is on the board (ignoring the _created timestamps).
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in exported if not name.endswith("_created")}
    on_board = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in referenced}
    assert families - on_board == set()


def test_per_arm_series_are_bounded_to_the_top_arms(sqlite_url, setup_a):
    """PASTO_METRICS_TOP_ARMS = 3 of 10 arms: three series per per-arm metric (the arms of highest
    probability; ties go to the lower position), the rest in one aggregate that keeps the totals."""
    from service.auth import create_token
    from tests.service.conftest import Api, make_app

    application = make_app(sqlite_url, PASTO_METRICS_TOP_ARMS=3)
    with get_db(application).write() as session:
        tokens = {role: create_token(session, role, f"test-{role}") for role in ("read", "ingest", "admin")}
    api = Api(application.test_client(), tokens)
    name = "many-arms"
    arms = [{"name": f"arm-{position}", "params": {"position": position}} for position in range(10)]
    assert api("POST", "/api/v1/experiments", json=setup_a(name, arms=arms)).status_code == 201
    units = [f"u{i}" for i in range(500)]
    answer = api("POST", f"/api/v1/experiments/{name}/assign", role="ingest", json={"units": units})
    assignments = answer.get_json()["assignments"]
    single = api("POST", f"/api/v1/experiments/{name}/assign", role="ingest", json={"unit": "one-more"}).get_json()
    assignments.append(single)
    batch = [{"id": a["unit"], "unit": a["unit"], "round": a["round"], "values": {"x": 1.0, "y": 1.0}}
             for a in assignments]
    assert api("POST", f"/api/v1/experiments/{name}/observations", role="ingest",
               json={"observations": batch}).status_code == 202
    samples = scrape(api)

    top = {"arm-0", "arm-1", "arm-2"}  # uniform p_0 = 0.1 each: the first three positions
    probabilities = by_label(samples["pasto_arm_probability"], "arm", experiment=name)
    assert set(probabilities) == top and all(math.isclose(p, 0.1) for p in probabilities.values())
    assert math.isclose(value(samples, "pasto_other_arms_probability", experiment=name), 0.7)
    assert set(by_label(samples["pasto_arm_deployed_probability"], "arm", experiment=name)) == top
    assert math.isclose(value(samples, "pasto_other_arms_deployed_probability", experiment=name), 0.7)
    assert value(samples, "pasto_arms", experiment=name) == 10

    per_arm = {arm: sum(1 for a in assignments if a["arm"] == arm) for arm in top}
    in_top = {arm: count for arm, count in per_arm.items() if count}
    assert by_label(samples["pasto_assignments_total"], "arm", experiment=name) == in_top
    assert by_label(samples["pasto_observations_total"], "arm", experiment=name) == in_top
    others = len(assignments) - sum(per_arm.values())
    assert others > 0
    assert value(samples, "pasto_other_arms_assignments_total", experiment=name) == others
    assert value(samples, "pasto_other_arms_observations_total", experiment=name) == others
    get_db(application).engine.dispose()


def test_top_arms_keeps_the_most_probable_and_breaks_ties_by_position():
    import numpy as np

    from service.monitoring import top_arms

    assert top_arms(np.array([0.1, 0.4, 0.1, 0.3, 0.1]), 2).tolist() == [1, 3]
    assert top_arms(np.array([0.25, 0.25, 0.25, 0.25]), 3).tolist() == [0, 1, 2]
    assert top_arms(np.array([0.5, 0.5]), 20).tolist() == [0, 1]


@pytest.mark.parametrize("setting", ["0", "-3", "many", "1.5"])
def test_an_unusable_top_arms_setting_is_refused(setting, sqlite_url):
    from service.config import ConfigurationError
    from tests.service.conftest import make_app

    with pytest.raises(ConfigurationError, match="PASTO_METRICS_TOP_ARMS must be a positive whole number of arms"):
        make_app(sqlite_url, PASTO_METRICS_TOP_ARMS=setting)


def _check_against_the_api(api, name: str, observed: int, late: int) -> None:
    experiment = api("GET", f"/api/v1/experiments/{name}", role="read").get_json()
    diagnostics = api("GET", f"/api/v1/experiments/{name}/diagnostics", role="read").get_json()
    samples = scrape(api)
    arm_names = [arm["name"] for arm in experiment["arms"]]
    assert value(samples, "pasto_round_index", experiment=name) == experiment["round"]["index"]
    assert value(samples, "pasto_applied_rounds", experiment=name) == experiment["applied_rounds"]
    assert by_label(samples["pasto_arm_probability"], "arm", experiment=name) == dict(
        zip(arm_names, experiment["probabilities"]))
    assert by_label(samples["pasto_arm_deployed_probability"], "arm", experiment=name) == dict(
        zip(arm_names, experiment["deployed"]))
    status = by_label(samples["pasto_experiment_status"], "status", experiment=name)
    assert status[experiment["status"]] == 1.0
    if diagnostics["srm"]["p_value"] is None:
        assert not [s for s in samples.get("pasto_srm_p_value", []) if s.labels["experiment"] == name]
    else:
        assert value(samples, "pasto_srm_p_value", experiment=name) == pytest.approx(
            diagnostics["srm"]["p_value"], rel=1e-9, abs=1e-300)
    assert value(samples, "pasto_observations_stored", experiment=name) == observed
    assert value(samples, "pasto_late_observations", experiment=name) == diagnostics["late_observations"] == late
    # Both read this process's running sums: check them against the sums over every round's rows.
    app = api.client.application
    with app.app_context(), get_db(app).read() as session:
        experiment_id = session.execute(sa.select(Experiment.id).where(Experiment.name == name)).scalar_one()
        units, late_from_rows, srm = reports.traffic_report(get_uow(app), session, experiment_id, len(arm_names))
    assert diagnostics["units"] == units.astype(int).tolist() and late_from_rows == late
    if srm["p_value"] is None:
        assert diagnostics["srm"]["p_value"] is None
    else:
        assert diagnostics["srm"]["p_value"] == pytest.approx(srm["p_value"], rel=1e-9, abs=1e-300)
    if experiment["applied_rounds"]:
        assert math.isclose(value(samples, "pasto_regret_cumulative_estimate", experiment=name),
                            diagnostics["regret"]["cumulative"], rel_tol=1e-9)


def test_scrapes_between_changes_agree_with_the_api_as_a_first_scrape_does(backend_api, backend_url, setup_a):
    """A process keeps what only changes with an experiment's version between scrapes, and the
    traffic sums as running totals (``controller.reports.controller_metrics``): after each kind of
    change (observations, a round, late data, a pause, a summary stored after the close) a scrape
    still reports what the API says."""
    api = backend_api
    name = "cached"
    assert api("POST", "/api/v1/experiments", json=setup_a(name)).status_code == 201
    _check_against_the_api(api, name, observed=0, late=0)
    play_rounds(api, name, rounds=1)
    _check_against_the_api(api, name, observed=60, late=0)
    late_units = [f"late-u{i}" for i in range(30)]
    assigned = api("POST", f"/api/v1/experiments/{name}/assign", role="ingest",
                   json={"units": late_units}).get_json()["assignments"]
    api("POST", "/api/v1/experiments/{}/observations".format(name), role="ingest", json={"observations": [
        {"id": f"late-{i}", "unit": a["unit"], "round": 0, "values": {"x": 1.0, "y": 1.0}}
        for i, a in enumerate(assigned)]})
    _check_against_the_api(api, name, observed=90, late=30)
    for played in (2, 3):
        play_rounds(api, name, rounds=1, first=played - 1)
        _check_against_the_api(api, name, observed=90 + 60 * (played - 1), late=30)
    assert api("POST", f"/api/v1/experiments/{name}/pause").status_code == 200
    _check_against_the_api(api, name, observed=210, late=30)

    # The latest summary is written after the close's transaction, without a new version: a scrape
    # in between has no objective; the next one has it.
    engine = sa.create_engine(backend_url)
    try:
        with engine.begin() as connection:
            summary = connection.execute(sa.select(Round.summary).where(Round.index == 2)).scalar_one()
            connection.execute(sa.update(Round).where(Round.index == 2).values(summary=sa.null()))
        assert "pasto_objective_estimate" not in {name for name, samples in scrape(api).items() if samples}
        with engine.begin() as connection:
            connection.execute(sa.update(Round).where(Round.index == 2).values(summary=summary))
    finally:
        engine.dispose()
    assert value(scrape(api), "pasto_objective_estimate", experiment=name, mixture="served") == summary["objective"]
