"""A small real OpenAI-style HTTP server for client tests: streams ``max_tokens`` text chunks,
refuses or breaks the requests a policy picks, and answers ``pdserve_timings`` as pdserve's
ingress does (one chunk with a list, one object per choice, just before ``[DONE]``)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# What the n-th request (0-based, in arrival order) gets: None to stream, or "429", "500",
# "midstream" (an error event after two chunks).
Policy = Callable[[int], str | None]

TIMINGS = {"path": "disaggregated", "status": "ok", "finish_reason": "length",
           "fallback_reason": None, "prefix_hit_tokens": 0, "prefill_tokens_computed": None,
           "tokenize_ms": 1.5, "decode_reserve_ms": 0.5, "prefill_queue_ms": 2.0,
           "prefill_compute_ms": 4.0, "handoff_bytes": 65536, "handoff_ms": 6.0,
           "handoff_exposed_ms": 1.0, "tpot_ms": 2.0}


@dataclass
class FakeServer:
    policy: Policy
    token_delay_s: float = 0.002
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake-model", "max_model_len": 2048}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await request.json()
            n = len(self.bodies)
            self.bodies.append(body)
            self.auth_headers.append(request.headers.get("authorization"))
            verdict = self.policy(n)
            if verdict in ("429", "500"):
                message = "too many requests" if verdict == "429" else "internal error"
                return JSONResponse({"error": {"message": message, "type": "x", "code": None}},
                                    status_code=int(verdict))
            return StreamingResponse(self._stream(n, body, verdict == "midstream"),
                                     media_type="text/event-stream")

        return app

    async def _stream(self, n: int, body: dict[str, Any], fail: bool) -> AsyncIterator[str]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            async for event in self._events(n, body, fail):
                yield event
        finally:
            self.in_flight -= 1

    async def _events(self, n: int, body: dict[str, Any], fail: bool) -> AsyncIterator[str]:
        started = time.perf_counter()
        head = {"id": f"cmpl-{n}", "object": "text_completion", "created": 0,
                "model": body["model"]}
        for k in range(body["max_tokens"]):
            await asyncio.sleep(self.token_delay_s)
            if fail and k == 2:
                yield f"data: {json.dumps({'error': {'message': 'decode worker died'}})}\n\n"
                yield "data: [DONE]\n\n"
                return
            # Raw U+2028 and U+0085 (JSON leaves them unescaped) inside the text, as a model's
            # output can hold them: they must not split the SSE line.
            text = f" t{k}\u2028\x85"
            chunk = {**head, "choices": [{"index": 0, "text": text, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        prompt = len(body["prompt"])
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"],
                     "total_tokens": prompt + body["max_tokens"]}
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
        if body.get("pdserve_timings"):
            e2e = (time.perf_counter() - started) * 1e3
            timings = {**TIMINGS, "request_id": f"cmpl-{n}", "num_prompt_tokens": prompt,
                       "num_output_tokens": body["max_tokens"], "ttft_ms": 9.0, "e2e_ms": e2e}
            yield f"data: {json.dumps({**head, 'choices': [], 'pdserve_timings': [timings]})}\n\n"
        yield "data: [DONE]\n\n"


@contextmanager
def serving(server: FakeServer) -> Iterator[FakeServer]:
    """Serve on a port the OS picks, in a thread; stop on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(server.app(), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline:
            raise AssertionError("fake server did not start")
        time.sleep(0.01)
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield server
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()
