"""The served OpenAPI document describes every request and response body, and schemathesis,
driven by it against the real served app, finds no 5xx and only OpenAI-shaped errors.
"""

from __future__ import annotations

import httpx
import pytest

from tests.faults.edge_apps import assert_openai_error

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]

GENERATION_PATHS = {"/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletionResponse"),
                    "/v1/completions": ("CompletionRequest", "CompletionResponse")}
# Bounded: every example of a generation endpoint may decode up to the app's max_model_len.
MAX_EXAMPLES = {"POST": 40, "GET": 5}


def test_openapi_declares_request_and_response_bodies(open_app: str) -> None:
    document = httpx.get(f"{open_app}/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    for path, (request, response) in GENERATION_PATHS.items():
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request}"}
        ok = operation["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert "text/event-stream" in ok
        assert operation["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
        assert schemas[request]["properties"]["model"]["enum"] == ["tiny"]
    assert {"messages", "model"} <= set(schemas["ChatCompletionRequest"]["required"])
    assert {"prompt", "model"} <= set(schemas["CompletionRequest"]["required"])
    models = document["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    assert models["application/json"]["schema"] == {"$ref": "#/components/schemas/ModelList"}


def test_schemathesis_finds_no_server_errors(open_app: str) -> None:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{open_app}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(GENERATION_PATHS)
    for operation in operations:
        # Invalid input needs something to be invalid: the endpoints with a body.
        has_body = operation.method.upper() == "POST"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:2 if has_body else 1]:
            @settings(max_examples=MAX_EXAMPLES[operation.method.upper()], deadline=None,
                      database=None, phases=[Phase.generate], derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case: schemathesis.Case) -> None:
                response = case.call(base_url=open_app, timeout=60)
                case.validate_response(response, checks=checks)
                if response.status_code >= 400:
                    assert_openai_error(response.json())

            fuzz()
    assert httpx.get(f"{open_app}/health", timeout=30).status_code == 200
