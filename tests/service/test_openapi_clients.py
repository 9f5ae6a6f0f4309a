"""The OpenAPI document with third-party tools: openapi-spec-validator accepts it, and a client generated
from it by openapi-python-client (the document as its only input) drives an experiment on a live server
from creation to diagnostics. Also: every operation has an operationId, request schemas are as strict
as the server, nullable timestamps are typed date-time."""

from __future__ import annotations

import datetime
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.openapi import openapi_document

GENERATED = "pasto_generated"


def operations(document: dict) -> list[tuple[str, str, dict]]:
    return [(method, path, operation) for path, item in document["paths"].items()
            for method, operation in item.items() if method in ("get", "post", "put", "delete", "patch")]


def test_an_independent_validator_accepts_the_document():
    from openapi_spec_validator import validate

    validate(openapi_document())


def test_every_operation_has_a_unique_operation_id():
    ids = [operation.get("operationId") for _, _, operation in operations(openapi_document())]
    assert None not in ids and len(set(ids)) == len(ids), ids
    assert {"createExperiment", "assign", "ingestObservations", "closeRound", "getDiagnostics"} <= set(ids)


def test_request_schemas_are_as_strict_as_the_server(api, setup_a):
    from jsonschema import Draft202012Validator

    document = openapi_document()
    observation = document["components"]["schemas"]["Observation"]
    values = Draft202012Validator(observation["properties"]["values"])
    assert values.is_valid({"x": 1.0})
    assert not values.is_valid({"not a metric name": 1.0})  # the server's MetricName pattern
    assert api("POST", "/api/v1/experiments", json=setup_a("strict")).status_code == 201
    refused = api("POST", "/api/v1/experiments/strict/observations", role="ingest", json={"observations": [
        {"id": "o1", "unit": "u1", "round": 0, "values": {"not a metric name": 1.0}}]})
    assert refused.status_code == 422

    (limit,) = [parameter for parameter in document["paths"]["/api/v1/experiments/{name}/rounds"]["get"]["parameters"]
                if parameter["name"] == "limit"]
    assert limit["schema"]["maximum"] == 1000
    for text, status in (("1000", 200), ("1001", 422), ("1" * 20, 422)):
        answer = api("GET", f"/api/v1/experiments/strict/rounds?limit={text}", role="read")
        assert answer.status_code == status, text
    message = api("GET", f"/api/v1/experiments/strict/rounds?limit={'1' * 20}", role="read").get_json()
    assert "between 1 and 1000" in json.dumps(message)


def test_nullable_timestamps_are_date_times():
    schemas = openapi_document()["components"]["schemas"]
    for model, field in (("RoundView", "closed_at"), ("RoundView", "applied_at"), ("Experiment", "archived_at"),
                         ("HealthScheduler", "last_heartbeat")):
        schema = schemas[model]["properties"][field]
        assert "format" not in schema
        assert {"type": "string", "format": "date-time"} in schema["anyOf"] and {"type": "null"} in schema["anyOf"]


@pytest.fixture
def generated_client(tmp_path, monkeypatch):
    """The package openapi-python-client generates from the document, importable as ``pasto_generated``."""
    command = shutil.which("openapi-python-client", path=str(Path(sys.executable).parent))
    assert command is not None, "openapi-python-client is in the test extra (pip install -e '.[test]')"
    document = tmp_path / "openapi.json"
    document.write_text(json.dumps(openapi_document()))
    config = tmp_path / "config.yml"
    config.write_text(f"package_name_override: {GENERATED}\npost_hooks: []\n")
    output = tmp_path / "generated" / GENERATED
    completed = subprocess.run([command, "generate", "--path", str(document), "--config", str(config), "--meta", "none",
                                "--output-path", str(output)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "Warning" not in completed.stdout + completed.stderr, completed.stdout + completed.stderr
    monkeypatch.syspath_prepend(str(output.parent))
    yield importlib.import_module(GENERATED)
    for name in [name for name in sys.modules if name == GENERATED or name.startswith(f"{GENERATED}.")]:
        del sys.modules[name]


def test_a_generated_client_drives_an_experiment(generated_client, app, tokens, serve, setup_a):
    models = importlib.import_module(f"{GENERATED}.models")
    url = serve(app)
    admin = generated_client.AuthenticatedClient(base_url=url, token=tokens["admin"])
    ingest = generated_client.AuthenticatedClient(base_url=url, token=tokens["ingest"])
    read = generated_client.AuthenticatedClient(base_url=url, token=tokens["read"])

    # Module (method) names come from the operationIds, not from the paths.
    create, assign, observe, close, diagnose = (
        importlib.import_module(f"{GENERATED}.api.default.{module}")
        for module in ("create_experiment", "assign", "ingest_observations", "close_round", "get_diagnostics"))

    created = create.sync_detailed(client=admin, body=models.ExperimentCreate.from_dict(setup_a("generated")))
    assert created.status_code == 201, created.content
    assert isinstance(created.parsed, models.Experiment) and created.parsed.name == "generated"

    fresh = diagnose.sync(name="generated", client=read)
    assert isinstance(fresh, models.Diagnostics) and fresh.best_single is None  # no data yet: null

    units = [f"u{i}" for i in range(40)]
    batch = assign.sync(name="generated", client=ingest, body=models.AssignMany.from_dict({"units": units}))
    assert isinstance(batch, models.AssignmentBatch) and len(batch.assignments) == 40
    means = {"a": (2.0, -2.0), "b": (0.0, 2.0)}
    observations = [{"id": f"o-{a.unit}", "unit": a.unit, "round": a.round_, "arm": a.arm,
                     "values": {"x": means[a.arm][0] + (i % 3 - 1) * 0.1, "y": means[a.arm][1] + (i % 5 - 2) * 0.1}}
                    for i, a in enumerate(batch.assignments)]
    stored = observe.sync_detailed(name="generated", client=ingest,
                                   body=models.ObservationBatch.from_dict({"observations": observations}))
    assert stored.status_code == 202 and stored.parsed.accepted == 40, stored.content

    closed = close.sync_detailed(name="generated", client=admin)
    assert closed.status_code == 200, closed.content

    diagnostics = diagnose.sync(name="generated", client=read)
    assert isinstance(diagnostics, models.Diagnostics)
    assert diagnostics.round_ == 1 and isinstance(diagnostics.objective.deployed, float)
    assert diagnostics.best_single.arm in ("a", "b")

    rounds = importlib.import_module(f"{GENERATED}.api.default.list_rounds").sync(name="generated", client=read)
    assert isinstance(rounds.rounds[0].closed_at, datetime.datetime)  # typed from format: date-time
    assert rounds.rounds[-1].closed_at is None
