"""The HTTP guard as ASGI: key checks by path and setting, and a body read that stops at the
limit (counted on a body that never ends), on a real FastAPI app with pdserve's handlers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.router.http_errors import install_error_handlers
from pdserve.router.http_guard import ApiKeys, HttpGuard, HttpGuardSettings

KEY = "unit-test-key-0123456789abcdef"


def _app(settings: HttpGuardSettings) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(HttpGuard, settings=settings)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"num_bytes": len(await request.body())}

    @app.get("/metrics")
    async def metrics() -> dict[str, str]:
        return {"ok": "metrics"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _settings(**changes: Any) -> HttpGuardSettings:
    values: dict[str, Any] = {"max_body_bytes": 4 << 20, "api_keys": (),
                              "metrics_require_api_key": True}
    return HttpGuardSettings(**(values | changes))


async def _get(app: FastAPI, path: str, headers: dict[str, str] | None = None,
               root_path: str = "") -> httpx.Response:
    transport = httpx.ASGITransport(app=app, root_path=root_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(f"{root_path}{path}", headers=headers)


@pytest.mark.parametrize("metrics_need_key", [True, False])
def test_metrics_key_is_configurable_and_health_open(metrics_need_key: bool) -> None:
    app = _app(_settings(api_keys=(KEY,), metrics_require_api_key=metrics_need_key))
    assert asyncio.run(_get(app, "/metrics")).status_code == (401 if metrics_need_key else 200)
    assert asyncio.run(_get(app, "/health")).status_code == 200
    good = {"Authorization": f"Bearer {KEY}"}
    assert asyncio.run(_get(app, "/metrics", good)).status_code == 200


def test_paths_are_read_below_the_mount_point() -> None:
    app = _app(_settings(api_keys=(KEY,)))
    assert asyncio.run(_get(app, "/health", root_path="/myapp")).status_code == 200
    assert asyncio.run(_get(app, "/metrics", root_path="/myapp")).status_code == 401


def test_keys_match_exactly() -> None:
    keys = ApiKeys([KEY, "second-key-0123456789abcdef"])
    for header in (f"Bearer {KEY}".encode(), b"BEARER second-key-0123456789abcdef"):
        keys.check(header)
    for header in (None, b"", KEY.encode(), f"Bearer {KEY[:-1]}".encode(),
                   f"Bearer {KEY} x".encode(), f"Token {KEY}".encode()):
        with pytest.raises(Exception, match="API key"):
            keys.check(header)
    assert not ApiKeys([])


def test_streamed_responses_pass_through_as_sent() -> None:
    async def scenario() -> list[bytes]:
        transport = httpx.ASGITransport(app=_app(_settings()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            async with client.stream("GET", "/stream") as r:
                return [chunk async for chunk in r.aiter_raw()]
    assert b"".join(asyncio.run(scenario())) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


def _drive(app: Any, headers: list[tuple[bytes, bytes]],
           body_chunks: int | None) -> tuple[int, dict[str, Any], int]:
    """Run one request straight through ASGI: status, JSON body, and how many body chunks
    the app pulled (``body_chunks`` None: a body that never ends)."""
    pulled, sent = 0, []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        more = body_chunks is None or pulled < body_chunks
        return {"type": "http.request", "body": b"x" * 1024, "more_body": more}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/echo", "raw_path": b"/echo", "root_path": "",
             "query_string": b"", "headers": headers, "server": ("test", 80),
             "client": ("test", 1)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), pulled


def test_a_body_that_never_ends_is_read_only_to_the_limit() -> None:
    app = _app(_settings(max_body_bytes=10 * 1024))
    status, body, pulled = _drive(app, [], body_chunks=None)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert pulled == 11  # 11 KiB read: over the limit, and not one chunk more


def test_a_declared_length_over_the_limit_reads_nothing() -> None:
    app = _app(_settings(max_body_bytes=10 * 1024))
    status, body, pulled = _drive(app, [(b"content-length", b"20480")], body_chunks=20)
    assert status == 413 and pulled == 0
    assert "20480" in body["error"]["message"]


def test_bodies_up_to_the_limit_are_read_whole() -> None:
    app = _app(_settings(max_body_bytes=10 * 1024))
    status, body, _ = _drive(app, [(b"content-length", b"10240")], body_chunks=10)
    assert (status, body) == (200, {"num_bytes": 10 * 1024})
