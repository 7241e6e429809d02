"""The ingress's OpenAPI document: request and response bodies from the pydantic models.

The endpoints parse raw bodies themselves (`protocol.parse_request`), so FastAPI cannot infer
their schemas; `install_openapi` declares them, for clients and schema-driven tools alike.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from pdserve.router.http_guard import METRICS_PATH, OPEN_PATHS, HttpGuardSettings
from pdserve.router.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)

_REF_TEMPLATE = "#/components/schemas/{model}"
# What each generation endpoint can answer besides 200 (see http_errors.py and http_guard.py).
_GENERATION_ERRORS = {
    "400": "Invalid request: the message names the field",
    "404": "Unknown model",
    "413": "Request body over http.max_body_bytes",
    "429": "Overloaded; retry after the Retry-After header's seconds",
    "503": "A worker role is unavailable",
    "504": "The request deadline passed",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class _Endpoint(BaseModel):
    path: str
    method: Literal["get", "post"]
    request: type[BaseModel] | None = None
    response: type[BaseModel]
    stream_chunk: type[BaseModel] | None = None


_ENDPOINTS = (
    _Endpoint(path="/v1/chat/completions", method="post", request=ChatCompletionRequest,
              response=ChatCompletionResponse, stream_chunk=ChatCompletionChunk),
    _Endpoint(path="/v1/completions", method="post", request=CompletionRequest,
              response=CompletionResponse, stream_chunk=CompletionResponse),
    _Endpoint(path="/v1/models", method="get", response=ModelList),
)


def install_openapi(app: FastAPI, served_model_name: str, guard: HttpGuardSettings) -> None:
    """Make ``app.openapi()`` (``GET /openapi.json``) describe every body pdserve reads or
    writes; ``model`` is declared as the one name this server serves."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version,
                                   description=app.description, routes=app.routes)
            _describe(document, served_model_name, guard)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe(document: dict[str, Any], served_model_name: str,
              guard: HttpGuardSettings) -> None:
    modes: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ErrorResponse, "serialization")]
    for endpoint in _ENDPOINTS:
        if endpoint.request is not None:
            modes.append((endpoint.request, "validation"))
        modes.append((endpoint.response, "serialization"))
        if endpoint.stream_chunk is not None:
            modes.append((endpoint.stream_chunk, "serialization"))
    refs, definitions = models_json_schema(list(dict.fromkeys(modes)), ref_template=_REF_TEMPLATE)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(definitions.get("$defs", {}))
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[name]["properties"]["model"] = {
            "type": "string", "enum": [served_model_name],
            "description": "Served model name; see GET /v1/models."}
    error = {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}}
    for endpoint in _ENDPOINTS:
        operation = document["paths"][endpoint.path][endpoint.method]
        ok: dict[str, Any] = {"application/json": {
            "schema": refs[(endpoint.response, "serialization")]}}
        if endpoint.stream_chunk is not None:
            ok["text/event-stream"] = {"schema": _event_schema(
                refs[(endpoint.stream_chunk, "serialization")],
                refs[(ErrorResponse, "serialization")])}
        operation["responses"] = {"200": {"description": "Success", "content": ok}}
        if endpoint.request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": refs[(endpoint.request, "validation")]}}}
            operation["responses"] |= {status: {"description": text, "content": error}
                                       for status, text in _GENERATION_ERRORS.items()}
    document["paths"][METRICS_PATH]["get"]["responses"] = {"200": {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}}}}
    if guard.api_keys:
        _declare_bearer_auth(document, guard, error)


def _event_schema(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event of a stream (each event is described on its own): a chunk, then
    ``[DONE]``; a failure after the first chunk sends an error body before ``[DONE]``."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [chunk, error]}}
    return {"type": "object", "required": ["data"], "properties": {
        "data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def _declare_bearer_auth(document: dict[str, Any], guard: HttpGuardSettings,
                         error: dict[str, Any]) -> None:
    document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in document["paths"].items():
        if path in OPEN_PATHS or (path == METRICS_PATH and not guard.metrics_require_api_key):
            continue
        for operation in operations.values():
            operation["security"] = [{"bearer": []}]
            operation.setdefault("responses", {})["401"] = {
                "description": "Missing or incorrect API key", "content": error}
