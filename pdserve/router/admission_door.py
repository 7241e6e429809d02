"""The admission check at the door: a completion request the gate would refuse is answered
(429 or 503, OpenAI's error body) and counted before routing, and before its body is read.

A pure ASGI middleware: a burst's refusals cost the server as little as possible, so that the
requests it serves and its /health answers stay quick while it refuses.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.admission import AdmissionGate
from pdserve.router.errors import OverloadedError, ServiceUnavailableError
from pdserve.router.http_errors import openai_error
from pdserve.router.http_guard import route_path
from pdserve.router.metrics import PdserveMetrics

ADMITTED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class AdmissionDoor:
    """Answers completion requests the `AdmissionGate` refuses; passes everything else on
    (the gate admits a request's choices once its body is parsed)."""

    def __init__(self, app: ASGIApp, gate: AdmissionGate, metrics: PdserveMetrics) -> None:
        self.app = app
        self.gate = gate
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST"
                and route_path(scope) in ADMITTED_PATHS):
            try:
                self.gate.check_open()
            except (OverloadedError, ServiceUnavailableError) as exc:
                self.metrics.observe_refusal(exc.kind)
                await _refuse(exc, send)
                return
        await self.app(scope, receive, send)


async def _refuse(exc: Exception, send: Send) -> None:
    answer = openai_error(exc)
    body = json.dumps(answer.body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in answer.headers.items()]
    # The body stays unread: the server closes the connection after this answer.
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
