"""The load client's one request: stream a completion from an OpenAI-compatible server and
time every chunk; an error status, an error event or a broken stream is a failed record.
The first chunk that carries a choice marks the first token (a token holding part of a
character may come without text); inter-token gaps are between chunks that carry text.

pdserve's per-request stage timings come back when the body asks ``"pdserve_timings": true``:
a ``pdserve_timings`` list (one object per choice) on a chunk of its own before ``[DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from pdserve.bench.records import RequestRecord
from pdserve.bench.workloads import PromptSpec

Api = Literal["completions", "chat"]
ERROR_TEXT_CHARS = 120


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: the server's base URL (with or without ``/v1``) and the body's
    fixed parts."""

    base_url: str
    model: str
    api: Api = "completions"
    api_key: str | None = None
    server_timings: bool = False  # ask pdserve for its stage timings
    ignore_eos: bool = True  # generate exactly max_tokens (vLLM and pdserve honour it)
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        root = self.base_url.rstrip("/").removesuffix("/v1")
        return f"{root}/v1/{'chat/completions' if self.api == 'chat' else 'completions'}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: PromptSpec, text: str | None = None) -> dict[str, Any]:
        """A streamed request for one prompt: token ids for completions (exact length), the
        prompt's text as one user message for chat."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": prompt.max_tokens,
                                "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.api == "chat":
            if text is None:
                raise ValueError("the chat API sends text: give the prompt's text")
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = list(prompt.prompt_ids)
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.server_timings:
            body["pdserve_timings"] = True
        return {**body, **self.extra_body}


class _Failed(Exception):
    """The server refused the request or reported an error inside the stream."""


@dataclass
class _Stream:
    first_choice_at: float | None = None  # the first chunk with a choice: the first token
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    timings: tuple[Mapping[str, Any], ...] = ()

    def take(self, event: Mapping[str, Any], at: float) -> None:
        if "error" in event:
            error = event["error"]
            message = error.get("message") if isinstance(error, Mapping) else error
            raise _Failed(f"in-stream error: {str(message)[:ERROR_TEXT_CHARS]}")
        if event.get("usage"):
            self.prompt_tokens = int(event["usage"].get("prompt_tokens", 0))
            self.output_tokens = int(event["usage"].get("completion_tokens", 0))
        if isinstance(event.get("pdserve_timings"), list):
            self.timings = tuple(event["pdserve_timings"])
        choices = event.get("choices") or ()
        if choices and self.first_choice_at is None:
            self.first_choice_at = at
        if any(_choice_text(c) for c in choices):
            self.chunk_times.append(at)


def _choice_text(choice: Mapping[str, Any]) -> str:
    delta = choice.get("delta")
    return str((delta.get("content") if isinstance(delta, Mapping) else None)
               or choice.get("text") or "")


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, body: Mapping[str, Any],
                       index: int, prompt_tokens: int, scheduled_s: float,
                       run_started: float) -> RequestRecord:
    """Send one streamed request now; its times count from this send."""
    sent = time.perf_counter()
    stream = _Stream()
    base = {"index": index, "prompt_tokens": prompt_tokens, "scheduled_s": scheduled_s,
            "sent_s": sent - run_started}
    try:
        async with client.stream("POST", endpoint.url, json=dict(body),
                                 headers=endpoint.headers()) as response:
            if response.status_code != 200:
                await response.aread()
                raise _Failed(f"HTTP {response.status_code}{_error_message(response)}")
            async for line in _sse_lines(response):
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                stream.take(json.loads(data), time.perf_counter() - sent)
    except _Failed as exc:
        return RequestRecord(ok=False, error=str(exc), **base)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestRecord(ok=False, error=f"{type(exc).__name__}: {str(exc)[:80]}".rstrip(": "),
                             **base)
    e2e = time.perf_counter() - sent
    if stream.first_choice_at is None:
        return RequestRecord(ok=False, error="stream ended without any generated token", **base)
    return RequestRecord(
        ok=True, output_tokens=stream.output_tokens or max(len(stream.chunk_times), 1),
        ttft_s=stream.first_choice_at, e2e_s=e2e, chunk_times_s=tuple(stream.chunk_times),
        server_timings=stream.timings,
        **{**base, "prompt_tokens": stream.prompt_tokens or prompt_tokens})


async def _sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body's lines split at \\n only: generated text may hold U+2028 or U+0085, which
    JSON leaves unescaped and str.splitlines (httpx's aiter_lines) would split at."""
    pending = b""
    async for piece in response.aiter_bytes():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


def _error_message(response: httpx.Response) -> str:
    """``: <message>`` of an OpenAI error body, empty when there is none."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, Mapping) else error
    return f": {str(message)[:ERROR_TEXT_CHARS]}" if message else ""


def fetch_model(base_url: str, api_key: str | None = None) -> tuple[str, int | None]:
    """The first model a server lists at /v1/models, and its max_model_len when it says."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{root}/v1/models", headers=headers, timeout=30.0, trust_env=False)
    response.raise_for_status()
    models: Sequence[Mapping[str, Any]] = response.json().get("data") or []
    if not models:
        raise ValueError(f"{root}/v1/models lists no model; pass --model")
    first = models[0]
    max_len = first.get("max_model_len")
    return str(first["id"]), int(max_len) if isinstance(max_len, int) else None
