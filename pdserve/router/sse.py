"""Server-sent-event framing of OpenAI streams: ``data: {json}\\n\\n`` chunks, then ``[DONE]``.

A stream is: per choice a first chunk (chat), text chunks and a finish chunk, the choices'
chunks interleaved as they come (each names its ``index``); then the usage chunk if asked
and ``[DONE]``.
A failure mid-stream sends `error_event` (an OpenAI error body; clients raise on it), then
``[DONE]``; the HTTP status is already 200 by then, so the body carries the error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router.http_errors import openai_error
from pdserve.router.protocol_responses import (
    ChoiceLogprobs,
    CompletionLogprobs,
    FinishReason,
    Usage,
)

DONE_EVENT = "data: [DONE]\n\n"
SSE_MEDIA_TYPE = "text/event-stream"


class EventStreamResponse(StreamingResponse):
    """An SSE response that runs ``on_close`` however sending ends. Starlette never starts
    the body when the client leaves while the headers go out, so the body's own ``finally``
    cannot be the only place that releases what the stream holds."""

    def __init__(self, events: AsyncGenerator[str, None],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type=SSE_MEDIA_TYPE)
        self._events, self._on_close = events, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()  # runs a started body's own finally first
            await self._on_close()


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One ``data:`` event; compact JSON keeps non-ASCII text as is (UTF-8 on the wire)."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    return f"data: {_json(data)}\n\n"


def error_event(exc: BaseException) -> str:
    """The event that reports a failure after the stream started (its detail is logged)."""
    return sse_event(openai_error(exc, "a stream").body)


def split_sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of a whole SSE body, in order (for clients and tests)."""
    payloads = []
    for event in text.split("\n\n"):
        lines = [line[len("data:"):].removeprefix(" ")
                 for line in event.split("\n") if line.startswith("data:")]
        if lines:
            payloads.append("\n".join(lines))
    return payloads


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _ChunkTemplate:
    """A stream's chunks share everything but their choices: the head and tail are encoded
    once, so a token costs one JSON string encoding, not a model built and dumped."""

    def __init__(self, request_id: str, obj: str, created: int, model: str,
                 include_usage: bool) -> None:
        self.head = (f'data: {{"id":{_json(request_id)},"object":"{obj}","created":{created},'
                     f'"model":{_json(model)},"choices":[')
        self.tail = '],"usage":null}\n\n' if include_usage else ']}\n\n'
        self.include_usage = include_usage

    def chunk(self, choice: str) -> str:
        return self.head + choice + self.tail

    def closing(self, usage: Usage | None, timings: list[dict[str, Any]] | None) -> str:
        """The usage chunk (if asked), the timings chunk (if asked), and ``[DONE]``."""
        out = ""
        if usage is not None and self.include_usage:
            out += self.head + '],"usage":' + _json(usage.model_dump(mode="json")) + "}\n\n"
        if timings is not None:
            out += self.head + '],"pdserve_timings":' + _json(timings) + "}\n\n"
        return out + DONE_EVENT


def _finish_json(finish_reason: FinishReason | None) -> str:
    return "null" if finish_reason is None else f'"{finish_reason}"'


class ChatStreamFormatter:
    """Chunks of one streamed chat completion (``chat.completion.chunk`` objects)."""

    def __init__(self, request_id: str, model: str, created: int,
                 include_usage: bool = False) -> None:
        self._t = _ChunkTemplate(request_id, "chat.completion.chunk", created, model,
                                 include_usage)

    def _choice(self, index: int, delta: str, logprobs: ChoiceLogprobs | None = None,
                finish_reason: FinishReason | None = None) -> str:
        lp = "null" if logprobs is None else _json(logprobs.model_dump(mode="json"))
        return self._t.chunk(f'{{"index":{index},"delta":{delta},"logprobs":{lp},'
                             f'"finish_reason":{_finish_json(finish_reason)}}}')

    def first(self, index: int = 0) -> str:
        """A choice's opening chunk: the assistant role, empty content."""
        return self._choice(index, '{"role":"assistant","content":""}')

    def delta(self, text: str, logprobs: ChoiceLogprobs | None = None, index: int = 0) -> str:
        return self._choice(index, '{"content":' + _json(text) + "}", logprobs)

    def tool_calls(self, calls: list[dict[str, Any]], index: int = 0) -> str:
        """A chunk of tool-call deltas (OpenAI's ``delta.tool_calls``)."""
        return self._choice(index, '{"tool_calls":' + _json(calls) + "}")

    def finish(self, finish_reason: FinishReason, index: int = 0) -> str:
        """A choice's finish chunk."""
        return self._choice(index, "{}", finish_reason=finish_reason)

    def end(self, usage: Usage, timings: list[dict[str, Any]] | None = None) -> str:
        """The usage chunk when asked for, the stage timings when asked for, ``[DONE]``."""
        return self._t.closing(usage, timings)


class CompletionStreamFormatter:
    """Chunks of one streamed text completion (``text_completion`` objects)."""

    def __init__(self, request_id: str, model: str, created: int,
                 include_usage: bool = False) -> None:
        self._t = _ChunkTemplate(request_id, "text_completion", created, model, include_usage)

    def _choice(self, index: int, text: str, logprobs: CompletionLogprobs | None = None,
                finish_reason: FinishReason | None = None) -> str:
        lp = "null" if logprobs is None else _json(logprobs.model_dump(mode="json"))
        return self._t.chunk(f'{{"index":{index},"text":{_json(text)},"logprobs":{lp},'
                             f'"finish_reason":{_finish_json(finish_reason)}}}')

    def delta(self, text: str, logprobs: CompletionLogprobs | None = None,
              index: int = 0) -> str:
        return self._choice(index, text, logprobs)

    def finish(self, finish_reason: FinishReason, index: int = 0) -> str:
        """A choice's finish chunk."""
        return self._choice(index, "", finish_reason=finish_reason)

    def end(self, usage: Usage, timings: list[dict[str, Any]] | None = None) -> str:
        """The usage chunk when asked for, the stage timings when asked for, ``[DONE]``."""
        return self._t.closing(usage, timings)
