"""Property-based API testing with schemathesis: every OpenAPI operation, bounded examples.

No 5xx anywhere; status codes, content types, headers and bodies conform to the published schema. Runs on
every backend, with the bootstrap admin token so generated requests reach the handlers, and a seeded
project so path parameters can name real things.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from conftest import new_project
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis import checks as st_checks
from svc_helpers import admin_headers, finding, ndjson, record, report, sha


@schemathesis.serializer("application/x-ndjson")
def _ndjson(ctx: Any, value: Any) -> bytes:
    """Generated bodies are strings (the schema says so) or anything else; send them as text lines."""
    if isinstance(value, bytes):
        return value
    return value.encode("utf-8", "surrogatepass") if isinstance(value, str) else json.dumps(value).encode()


schemathesis.serializer.alias("application/sarif+json", "application/json")

CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    st_checks.response_headers_conformance,
]


@pytest.fixture
def api_schema(client: TestClient) -> Any:
    seeded = new_project(client)
    seeded.upload(report(finding()), sha(1))
    client.post(
        seeded.url("/runs/run-1/records"),
        content=ndjson([record("run-1", i) for i in range(5)]),
        headers=seeded.headers("upload"),
    )
    # Fix the project to the seeded one (fuzzing names only meets 404s, which test_security covers).
    config = schemathesis.Config.from_dict({"parameters": {"path.project": seeded.name}})
    schema = schemathesis.openapi.from_asgi("/api/v1/openapi.json", client.app, config=config)
    return schema.include(path_regex="^/api/v1/")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_conforms_to_its_schema(case: Any) -> None:
    case.call_and_validate(headers=admin_headers(), checks=CHECKS)
