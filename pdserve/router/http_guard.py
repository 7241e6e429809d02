"""The HTTP edge's guard: API keys and the request body limit, as one pure ASGI middleware.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, so streamed responses pass through as sent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.errors import AuthenticationError, RequestTooLargeError
from pdserve.router.http_errors import openai_error

# Load balancers and orchestrators probe liveness without credentials.
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
_BEARER = b"bearer "


@dataclass(frozen=True, kw_only=True)
class HttpGuardSettings:
    """What the guard enforces (the http.* keys of the config schema, which checks them); no
    keys: every request passes the key check."""

    max_body_bytes: int
    api_keys: tuple[str, ...] = field(repr=False)
    metrics_require_api_key: bool


class ApiKeys:
    """Configured keys, compared in constant time: each candidate is hashed to a fixed length
    and checked against every key, so neither a key's content nor its length shows in timing."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(key.encode()) for key in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: bytes | None) -> None:
        """Raise AuthenticationError unless ``authorization`` is ``Bearer <a configured key>``."""
        if authorization is None or not authorization[:len(_BEARER)].lower() == _BEARER:
            raise AuthenticationError("missing API key: send it as 'Authorization: Bearer KEY'")
        candidate = _digest(authorization[len(_BEARER):].strip())
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        if not matched:
            raise AuthenticationError("incorrect API key provided")


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class HttpGuard:
    """Refuses, before the app sees them, requests without a valid API key (401) and bodies
    over the limit (413): a declared Content-Length at once, a streamed body as soon as its
    running count passes the limit, reading no further. Both answers are OpenAI error bodies."""

    def __init__(self, app: ASGIApp, settings: HttpGuardSettings) -> None:
        self.app = app
        self.settings = settings
        self.keys = ApiKeys(settings.api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        try:
            if self.keys and self._needs_key(route_path(scope)):
                self.keys.check(headers.get(b"authorization"))
            _check_declared_length(headers.get(b"content-length"), self.settings.max_body_bytes)
        except (AuthenticationError, RequestTooLargeError) as exc:
            await _answer(exc, scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _limited(receive, self.settings.max_body_bytes), tracked_send)
        except RequestTooLargeError as exc:  # an app without pdserve's error handlers
            if started:
                raise
            await _answer(exc, scope, receive, send)

    def _needs_key(self, path: str) -> bool:
        if path in OPEN_PATHS:
            return False
        return path != METRICS_PATH or self.settings.metrics_require_api_key


def route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve mounts an app at its route prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def _check_declared_length(value: bytes | None, limit: int) -> None:
    if value is not None and value.strip().isdigit() and int(value) > limit:
        raise RequestTooLargeError(limit, int(value))


def _limited(receive: Receive, limit: int) -> Receive:
    """``receive`` that counts body bytes and raises once they pass ``limit``: the app stops
    there, and nothing more of the body is read."""
    num_bytes = 0

    async def receive_within_limit() -> Message:
        nonlocal num_bytes
        message = await receive()
        if message["type"] == "http.request":
            num_bytes += len(message.get("body", b""))
            if num_bytes > limit:
                raise RequestTooLargeError(limit)
        return message

    return receive_within_limit


async def _answer(exc: Exception, scope: Scope, receive: Receive, send: Send) -> None:
    answer = openai_error(exc)
    headers = dict(answer.headers)
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    # The body may be unread: the server then closes the connection after this answer.
    await JSONResponse(answer.body, status_code=answer.status, headers=headers)(
        scope, receive, send)
