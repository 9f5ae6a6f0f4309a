"""The shipped Prometheus alerting rules (dashboards/prometheus/pasto-alerts.yml): promtool checks them
and runs their unit tests, every documented alert ships and has a test in which it fires, and the
counters those alerts read exist at 0 as soon as an experiment does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.service.test_monitoring import scrape, value

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards" / "prometheus" / "pasto-alerts.yml"
RULE_TESTS = ROOT / "dashboards" / "prometheus" / "pasto-alerts.test.yml"
MONITORING_DOC = ROOT / "docs" / "monitoring.md"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool is not installed (Debian package `prometheus`)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; .ci/run installs it and CI must run these checks.")
        pytest.skip(message)
    return found


def alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules():
    completed = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in completed.stdout


def test_promtool_runs_the_rule_tests():
    completed = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                               timeout=120, cwd=RULE_TESTS.parent)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "SUCCESS" in completed.stdout


def test_every_shipped_alert_is_documented_and_has_a_test_in_which_it_fires():
    names = alert_names()
    documented = set(re.findall(r"^\| `(Pasto\w+)` \|", MONITORING_DOC.read_text(), flags=re.MULTILINE))
    assert documented == set(names), "docs/monitoring.md's alert table and the rule file differ"
    fired = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test.get("alert_rule_test", []) if case.get("exp_alerts")}
    assert fired == set(names)


def test_the_counters_an_alert_reads_start_at_zero_when_the_experiment_exists(api, setup_a):
    """A fresh running experiment: its observation, duplicate and round-update counters are exported at 0
    before any event (PastoNoObservations can fire), and two duplicates then count from that 0."""
    assert api("POST", "/api/v1/experiments", json=setup_a("fresh")).status_code == 201
    samples = scrape(api)
    for arm in ("a", "b"):
        assert value(samples, "pasto_observations_total", experiment="fresh", arm=arm) == 0
        assert value(samples, "pasto_assignments_total", experiment="fresh", arm=arm) == 0
    for counter in ("pasto_other_arms_observations_total", "pasto_other_arms_assignments_total",
                    "pasto_duplicate_observations_total", "pasto_round_updates_total",
                    "pasto_round_update_duration_seconds_count"):
        assert value(samples, counter, experiment="fresh") == 0, counter
    assert value(samples, "pasto_experiment_status", experiment="fresh", status="running") == 1

    unit = api("POST", "/api/v1/experiments/fresh/assign", role="ingest", json={"unit": "u1"}).get_json()
    observation = {"id": "o1", "unit": "u1", "round": unit["round"], "values": {"x": 1.0, "y": 0.5}}
    for _ in range(3):  # the first is accepted, the next two are duplicates
        response = api("POST", "/api/v1/experiments/fresh/observations", role="ingest",
                       json={"observations": [observation]})
        assert response.status_code == 202
    samples = scrape(api)
    assert value(samples, "pasto_duplicate_observations_total", experiment="fresh") == 2
    assert value(samples, "pasto_observations_total", experiment="fresh", arm=unit["arm"]) == 1


def test_a_process_that_starts_after_the_experiment_exports_its_counters_at_the_first_scrape(api, setup_a):
    """A restarted process (a new app on the same database) has no events yet: its first scrape
    already has the experiment's counters at 0."""
    assert api("POST", "/api/v1/experiments", json=setup_a("before-restart")).status_code == 201
    from service.monitoring import DUPLICATE_OBSERVATIONS, _children

    # This process's registry is shared by every app in it: forget the series, as a new process would.
    for key in [key for key in _children if key[1:] == ("before-restart",)]:
        _children.pop(key)
    DUPLICATE_OBSERVATIONS.remove("before-restart")
    samples = scrape(api)
    assert value(samples, "pasto_duplicate_observations_total", experiment="before-restart") == 0
