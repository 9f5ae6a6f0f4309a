"""Every field of every response schema in the OpenAPI document is documented in docs/api.md."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from service.openapi import openapi_document
from tests.docs.conftest import REPOSITORY


def response_fields(schema: Any, components: dict[str, Any], where: str, seen: frozenset[str] = frozenset()
                    ) -> Iterator[tuple[str, str]]:
    """(field name, where it is) for every property of ``schema``, nested objects and arrays included."""
    if not isinstance(schema, dict):
        return
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in seen:
            yield from response_fields(components[name], components, name, seen | {name})
        return
    for field, subschema in schema.get("properties", {}).items():
        yield field, f"{where}.{field}"
        yield from response_fields(subschema, components, f"{where}.{field}", seen)
    for key in ("items", "additionalProperties"):
        yield from response_fields(schema.get(key), components, f"{where}[]", seen)


def documented_names(markdown: str) -> set[str]:
    """Names the page mentions as code (`name`) or as a JSON key ("name":)."""
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", markdown)) | set(re.findall(r'"([A-Za-z_]\w*)"\s*:', markdown))


def test_every_response_field_is_documented_in_api_md():
    document = openapi_document()
    components = document["components"]["schemas"]
    fields = {}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, response in operation.get("responses", {}).items():
                schema = response.get("content", {}).get("application/json", {}).get("schema")
                for field, where in response_fields(schema, components, f"{method.upper()} {path} {status}"):
                    fields.setdefault(field, where)
    assert {"confidently_holds", "late_observations", "closed_round"} <= set(fields)  # the walk reaches deep
    documented = documented_names((REPOSITORY / "docs" / "api.md").read_text())
    missing = {field: where for field, where in fields.items() if field not in documented}
    assert not missing, f"response fields not documented in docs/api.md: {missing}"


def test_an_undocumented_field_is_found():
    schema = {"type": "object", "properties": {"shown": {"type": "object", "properties": {"hidden_deep": {}}}}}
    fields = {field for field, _ in response_fields(schema, {}, "x")}
    assert fields == {"shown", "hidden_deep"}
    assert "hidden_deep" not in documented_names('Only `shown` and {"shown": 1} here.')
