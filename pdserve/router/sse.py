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
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router.http_errors import openai_error
from pdserve.router.protocol_responses import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
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
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(exc: BaseException) -> str:
    """The event that reports a failure after the stream started."""
    return sse_event(openai_error(exc).body)


def split_sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of a whole SSE body, in order (for clients and tests)."""
    payloads = []
    for event in text.split("\n\n"):
        lines = [line[len("data:"):].removeprefix(" ")
                 for line in event.split("\n") if line.startswith("data:")]
        if lines:
            payloads.append("\n".join(lines))
    return payloads


@dataclass(frozen=True)
class ChatStreamFormatter:
    """Chunks of one streamed chat completion (``chat.completion.chunk`` objects)."""

    request_id: str
    model: str
    created: int
    include_usage: bool = False

    def _event(self, delta: DeltaMessage, index: int, finish_reason: FinishReason | None = None,
               logprobs: ChoiceLogprobs | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model,
            choices=[ChatCompletionChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                               finish_reason=finish_reason)])
        data = chunk.model_dump(mode="json")
        # Deltas carry only what changed; OpenAI sends `usage: null` only when usage was asked.
        data["choices"][0]["delta"] = {k: v for k, v in data["choices"][0]["delta"].items()
                                       if v is not None}
        if not self.include_usage:
            del data["usage"]
        return sse_event(data)

    def first(self, index: int = 0) -> str:
        """A choice's opening chunk: the assistant role, empty content."""
        return self._event(DeltaMessage(role="assistant", content=""), index)

    def delta(self, text: str, logprobs: ChoiceLogprobs | None = None, index: int = 0) -> str:
        return self._event(DeltaMessage(content=text), index, logprobs=logprobs)

    def finish(self, finish_reason: FinishReason, index: int = 0) -> str:
        """A choice's finish chunk."""
        return self._event(DeltaMessage(), index, finish_reason=finish_reason)

    def end(self, usage: Usage) -> str:
        """The usage chunk when asked for, and ``[DONE]``."""
        if not self.include_usage:
            return DONE_EVENT
        chunk = ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                    choices=[], usage=usage)
        return sse_event(chunk) + DONE_EVENT


@dataclass(frozen=True)
class CompletionStreamFormatter:
    """Chunks of one streamed text completion (``text_completion`` objects)."""

    request_id: str
    model: str
    created: int
    include_usage: bool = False

    def _event(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        chunk = CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)
        data = chunk.model_dump(mode="json")
        if not self.include_usage:
            del data["usage"]
        return sse_event(data)

    def delta(self, text: str, logprobs: CompletionLogprobs | None = None,
              index: int = 0) -> str:
        return self._event([CompletionChoice(index=index, text=text, logprobs=logprobs)])

    def finish(self, finish_reason: FinishReason, index: int = 0) -> str:
        """A choice's finish chunk."""
        return self._event([CompletionChoice(index=index, text="", finish_reason=finish_reason)])

    def end(self, usage: Usage) -> str:
        """The usage chunk when asked for, and ``[DONE]``."""
        return (self._event([], usage=usage) if self.include_usage else "") + DONE_EVENT
