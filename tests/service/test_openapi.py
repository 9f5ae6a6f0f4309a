"""The OpenAPI document matches the application's routes, both ways, and is valid OpenAPI 3.1."""

from __future__ import annotations

import re

import pytest

NOT_API = {"static"}


def documented_operations(document) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item}


def routed_operations(app) -> set[tuple[str, str]]:
    operations = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint in NOT_API or rule.endpoint.split(".")[0] == "dashboard":
            continue  # HTML pages and static files are not part of the JSON API
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        operations |= {(method, path) for method in rule.methods - {"HEAD", "OPTIONS"}}
    return operations


def test_every_route_is_documented_and_every_documented_operation_exists(api, app):
    document = api("GET", "/api/v1/openapi.json", role=None).get_json()
    assert document["openapi"].startswith("3.1")
    assert routed_operations(app) == documented_operations(document)


def test_document_is_a_valid_openapi_3_1_schema_for_schemathesis(api):
    import schemathesis

    schemathesis.experimental.OPEN_API_3_1.enable()
    schema = schemathesis.from_dict(api("GET", "/api/v1/openapi.json", role=None).get_json(), validate_schema=True)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == len(documented_operations(schema.raw_schema))


def test_every_reference_resolves(api):
    document = api("GET", "/api/v1/openapi.json", role=None).get_json()
    schemas = document["components"]["schemas"]

    def walk(node):
        if isinstance(node, dict):
            reference = node.get("$ref")
            if reference is not None:
                assert reference.startswith("#/components/schemas/")
                assert reference.rsplit("/", 1)[1] in schemas, reference
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)


def test_request_examples_validate_against_the_published_schemas(api, setup_a):
    """What the API accepts is what the document says (the schemas come from the validators)."""
    import jsonschema

    document = api("GET", "/api/v1/openapi.json", role=None).get_json()

    def check(name, instance):
        schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
        jsonschema.Draft202012Validator(schema).validate(instance)

    check("ExperimentCreate", setup_a())
    check("AssignOne", {"unit": "u1"})
    check("AssignMany", {"units": ["u1", "u2"]})
    check("ObservationBatch", {"observations": [{"id": "o", "unit": "u", "round": 0, "values": {"x": 1.5}}]})
    with pytest.raises(jsonschema.ValidationError):
        check("ObservationBatch", {"observations": [{"id": "o", "unit": "u", "round": -1, "values": {"x": 1}}]})


def test_every_response_matches_its_published_schema(api, setup_a):
    """The response schemas come from the models the routes serialise with (``service.responses``):
    a session over every operation, each answer validated against what the document says of its
    path, method and status."""
    import jsonschema

    document = api("GET", "/api/v1/openapi.json", role=None).get_json()
    name = "setup-a"
    checked = []

    def check(method: str, template: str, path: str | None = None, role: str | None = "admin", **kwargs):
        response = api(method, path or template.replace("{name}", name), role=role, **kwargs)
        schema = document["paths"][template][method.lower()]["responses"][str(response.status_code)]
        schema = {**schema["content"]["application/json"]["schema"], "components": document["components"]}
        jsonschema.Draft202012Validator(schema).validate(response.get_json())
        checked.append((method, template, response.status_code))
        return response.get_json()

    experiments = "/api/v1/experiments"
    one = f"{experiments}/{{name}}"
    check("POST", experiments, json=setup_a(arms=[{"name": "a", "params": {"k": 1}}, {"name": "b"}, {"name": "c"}]))
    check("POST", experiments, json=setup_a())  # 409
    check("GET", experiments, role="read")
    check("GET", one, role="read")
    check("GET", one, path=f"{experiments}/nope", role="read")  # 404
    single = check("POST", f"{one}/assign", json={"unit": "u1"}, role="ingest")
    batch = check("POST", f"{one}/assign", json={"units": ["u1", "u2"]}, role="ingest")
    # Written without a model per unit (the hot path): the model's fields, in its order.
    from service.responses import Assignment
    # "segment" is the last field, sent only by segmented experiments (tests/service/test_segments.py).
    unsegmented_fields = [field for field in Assignment.model_fields if field != "segment"]
    assert list(Assignment.model_fields)[-1] == "segment"
    assert [list(single)] + [list(item) for item in batch["assignments"]] == [unsegmented_fields] * 3
    observations = [{"id": f"o{i}", "unit": f"u{i}", "round": 0, "values": {"x": i / 10}} for i in range(30)]
    check("POST", f"{one}/observations", json={"observations": observations}, role="ingest")
    check("POST", f"{one}/observations", json={"observations": [{"id": "o", "unit": "u", "round": 5,
                                                                   "values": {"x": 1}}]}, role="ingest")  # 422
    check("POST", f"{one}/rounds")
    check("POST", f"{one}/rounds", json={"round": 0})  # 409: round 0 is closed
    rounds = check("GET", f"{one}/rounds", role="read")["rounds"]
    assert rounds[0]["objective"] is not None and rounds[0]["best_single"] is not None
    check("GET", f"{one}/diagnostics", role="read")
    check("POST", f"{one}/pause")
    check("POST", f"{one}/resume")
    check("POST", f"{one}/stop")
    check("DELETE", one)  # 409: not archived
    check("POST", f"{one}/archive")
    check("GET", experiments, path=f"{experiments}?archived=true", role="read")
    check("DELETE", one)
    check("GET", "/healthz", role=None)
    assert {status for _, _, status in checked} == {200, 201, 202, 404, 409, 422}


def test_every_authenticated_operation_documents_429_and_503_with_retry_after(api):
    """A client generated from the document must know that these two are retried after Retry-After."""
    document = api("GET", "/api/v1/openapi.json", role=None).get_json()
    authenticated = [(path, method, operation) for path, item in document["paths"].items()
                     for method, operation in item.items() if "401" in operation["responses"]]
    assert len(authenticated) >= 15
    for path, method, operation in authenticated:
        for status in ("429", "503"):
            response = operation["responses"].get(status)
            assert response is not None, (method, path, status)
            assert response["headers"]["Retry-After"]["schema"]["type"] == "integer", (method, path, status)
