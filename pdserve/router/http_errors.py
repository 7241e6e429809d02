"""Exceptions to HTTP statuses and OpenAI error bodies ``{"error": {message, type, param, code}}``.

`install_error_handlers(app)` makes every error leave a FastAPI app in that shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    OutOfKVBlocksError,
    PromptTooLongError,
)
from pdserve.router.errors import (
    AuthenticationError,
    ModelNotFoundError,
    OverloadedError,
    RequestTimeoutError,
    RequestTooLargeError,
    RouterError,
    ServiceUnavailableError,
)

logger = logging.getLogger(__name__)

INTERNAL_ERROR_MESSAGE = "internal server error; the server log has the details"


@dataclass(frozen=True)
class ErrorSpec:
    """How one class of exception is answered."""

    status: int
    type: str
    code: str | None = None
    # What the client reads when the exception is not pdserve's own: foreign messages (Ray's
    # above all) carry pids, actor ids, node addresses and tracebacks, which stay in the log.
    public_message: str = "the request failed; the server log has the details"


_BAD_REQUEST = ErrorSpec(400, "invalid_request_error")
_INTERNAL = ErrorSpec(500, "server_error", "internal_error")
_SPECS: MappingProxyType[type[BaseException], ErrorSpec] = MappingProxyType({
    ValidationError: _BAD_REQUEST,
    RequestValidationError: _BAD_REQUEST,
    json.JSONDecodeError: _BAD_REQUEST,
    PromptTooLongError: ErrorSpec(400, "invalid_request_error", "context_length_exceeded"),
    OutOfKVBlocksError: ErrorSpec(400, "invalid_request_error", "kv_cache_too_small"),
    InvalidRequestError: _BAD_REQUEST,
    ModelNotFoundError: ErrorSpec(404, "invalid_request_error", "model_not_found"),
    AuthenticationError: ErrorSpec(401, "invalid_request_error", "invalid_api_key"),
    RequestTooLargeError: ErrorSpec(413, "invalid_request_error", "request_too_large"),
    OverloadedError: ErrorSpec(429, "rate_limit_error", "overloaded"),
    ServiceUnavailableError: ErrorSpec(503, "server_error", "service_unavailable"),
    RequestTimeoutError: ErrorSpec(504, "server_error", "timeout"),
    # Its message names the crash (a collective's peer address, say): the log keeps that.
    EngineDeadError: ErrorSpec(503, "server_error", "service_unavailable",
                               "the worker serving this request stopped; retry it"),
})
# pdserve's own exceptions whose message is for the log, not the client.
_LOGGED_ONLY = (EngineDeadError,)
# Ray's exceptions by qualified name, so this module need not import Ray.
_SPECS_BY_NAME: MappingProxyType[str, ErrorSpec] = MappingProxyType({
    "ray.serve.exceptions.BackPressureError": ErrorSpec(
        429, "rate_limit_error", "overloaded", "the server is at capacity; retry later"),
    "ray.serve.exceptions.DeploymentUnavailableError": ErrorSpec(
        503, "server_error", "service_unavailable", "a worker role is unavailable; retry later"),
    "ray.exceptions.RayActorError": ErrorSpec(
        503, "server_error", "service_unavailable",
        "a worker failed while serving this request; retry it"),
})
_RETRY_AFTER_NAMES = frozenset({"ray.serve.exceptions.BackPressureError"})
_LOCATION_PREFIXES = frozenset({"body", "query", "path", "header"})
_NOT_AN_OBJECT = frozenset({"model_type", "model_attributes_type", "dict_type"})


@dataclass(frozen=True)
class OpenAIError:
    """A ready answer: status, OpenAI error body and extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def unwrap_remote_error(exc: BaseException) -> BaseException:
    """The user's exception inside Ray's RayTaskError wrappers (their str holds a traceback)."""
    for _ in range(8):  # wrappers nest once per remote hop; 8 is far beyond any real chain
        is_wrapper = any(c.__name__ == "RayTaskError" for c in type(exc).__mro__)
        cause = getattr(exc, "cause", None)
        if not is_wrapper or not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def spec_for(exc: BaseException) -> ErrorSpec:
    """The most specific spec along the exception's class hierarchy; unknown: 500."""
    for cls in type(exc).__mro__:
        if cls in _SPECS:
            return _SPECS[cls]
        spec = _SPECS_BY_NAME.get(_qualified_name(cls))
        if spec is not None:
            return spec
    return _INTERNAL


def _is_pdserve_error(exc: BaseException) -> bool:
    """Whether the message is pdserve's own, written for the client."""
    return type(exc).__module__.split(".")[0] == "pdserve"


def _clean_loc(loc: Sequence[str | int]) -> list[str | int]:
    parts = list(loc)
    if parts and parts[0] in _LOCATION_PREFIXES:
        parts = parts[1:]
    # pydantic names union members in locs ("str", "list[int]"); they are not fields.
    return [p for p in parts if not (isinstance(p, str) and ("[" in p or p in {"str", "int"}))]


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str | None, str]:
    """``(param, message)`` for pydantic/FastAPI errors; param is the first bad field's path."""
    if not errors:
        return None, "invalid request"
    lines: list[str] = []
    first_param: str | None = None
    for error in errors[:3]:
        loc = _clean_loc(error.get("loc", ()))
        kind = error.get("type", "")
        if kind == "json_invalid":
            detail = str((error.get("ctx") or {}).get("error") or error.get("msg", ""))
            return None, f"request body is not valid JSON: {detail.removeprefix('Invalid JSON: ')}"
        if not loc and kind in _NOT_AN_OBJECT:
            return None, "request body must be a JSON object"
        param = ".".join(str(p) for p in loc) or None
        first_param = first_param or param
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "extra_forbidden":
            message = ("unrecognized request argument; remove it (GET /openapi.json lists "
                       "the fields this server takes)")
        lines.append(f"{param}: {message}" if param else message)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return first_param, "; ".join(lines) + more


def openai_error(exc: BaseException, context: str = "") -> OpenAIError:
    """Status, body and headers for any exception. Unexpected ones are logged with their
    trace, foreign ones (Ray's) with their message, both with ``context`` (e.g. the request's
    method and path); neither message reaches the client."""
    exc = unwrap_remote_error(exc)
    spec = spec_for(exc)
    headers: dict[str, str] = {}
    param: str | None = None
    if isinstance(exc, (ValidationError, RequestValidationError)):
        param, message = describe_validation_errors(exc.errors())
    elif isinstance(exc, json.JSONDecodeError):
        message = (f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                   f"column {exc.colno}")
    elif isinstance(exc, ModelNotFoundError):
        param, message = "model", str(exc)
    elif spec is _INTERNAL:
        logger.error("unhandled %s %s: %s", context, type(exc).__name__, exc, exc_info=exc)
        message = INTERNAL_ERROR_MESSAGE
    elif _is_pdserve_error(exc) and not isinstance(exc, _LOGGED_ONLY):
        message = str(exc) or type(exc).__name__
    else:
        logger.warning("%s failed (answered %d): %s: %s", context or "request", spec.status,
                       type(exc).__name__, exc)
        message = spec.public_message
    if isinstance(exc, OverloadedError):
        headers["Retry-After"] = exc.retry_after_header
    elif any(_qualified_name(c) in _RETRY_AFTER_NAMES for c in type(exc).__mro__):
        headers["Retry-After"] = "1"
    return OpenAIError(spec.status, error_body(message, spec.type, param, spec.code), headers)


def error_response(exc: BaseException, context: str = "") -> JSONResponse:
    answer = openai_error(exc, context)
    return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers or None)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, StarletteHTTPException):
        # Unknown routes, wrong methods and explicit HTTPExceptions keep their status.
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=dict(exc.headers or {}) or None)
    return error_response(exc, f"{request.method} {request.url.path}")


def install_error_handlers(app: FastAPI,
                           extra_exception_classes: Iterable[type[Exception]] = ()) -> None:
    """Answer every error of ``app`` with an OpenAI error body and the mapped status.

    Classes registered here are answered by Starlette's exception middleware. ``Exception``
    is the 500 catch-all: Starlette answers it too but then re-raises it to the server, which
    logs it; pass expected foreign classes (e.g. ``ray.serve.exceptions.BackPressureError``)
    in ``extra_exception_classes`` so they are answered without that re-raise.
    """
    classes: list[type[Exception]] = [
        RequestValidationError, ValidationError, json.JSONDecodeError, StarletteHTTPException,
        EngineError, RouterError, *extra_exception_classes, Exception,
    ]
    for cls in classes:
        app.add_exception_handler(cls, _handle)
