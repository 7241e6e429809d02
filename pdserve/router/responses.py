"""OpenAI response bodies from a request's finished choices, and its SSE chunks as they come.

The ingress runs the choices; this module only turns their deltas and outcomes into bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.choices import ChoiceRun
from pdserve.router.delta import GenerationDelta
from pdserve.router.logprobs import LogprobsFormatter
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.protocol_responses import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ResponseFunctionCall,
    ResponseToolCall,
    Usage,
)
from pdserve.router.sse import ChatStreamFormatter, CompletionStreamFormatter
from pdserve.router.tool_stream import ToolCallDelta, ToolCallStream
from pdserve.router.tools import split_calls

AnyRequest = ChatCompletionRequest | CompletionRequest


def usage_of(runs: list[ChoiceRun], num_prompt_tokens: int) -> Usage:
    """The prompt counts once, whatever ``n``; completion tokens add up over the choices."""
    return Usage.from_counts(num_prompt_tokens, sum(r.outcome.num_output_tokens for r in runs),
                             max(r.outcome.num_cached_tokens for r in runs))


def timings_of(runs: list[ChoiceRun]) -> list[dict[str, Any]]:
    """Each choice's stage timings, in index order (``pdserve_timings``)."""
    return [asdict(run.trace.timings) for run in sorted(runs, key=lambda r: r.index)]


@dataclass(frozen=True)
class ResponseContext:
    request: AnyRequest
    request_id: str
    model: str
    created: int
    num_prompt_tokens: int
    chat: bool

    @property
    def wants_logprobs(self) -> bool:
        return self.request.requested_logprobs() is not None

    @property
    def calls_tools(self) -> bool:
        return isinstance(self.request, ChatCompletionRequest) and self.request.calls_tools


def assistant_message(ctx: ResponseContext, run: ChoiceRun) -> tuple[AssistantMessage, str]:
    """A choice's message and finish reason: with tools, the ``<tool_call>`` blocks of its text
    become ``tool_calls`` and a choice that stopped after one finishes with ``tool_calls``."""
    text, reason = run.outcome.text, run.outcome.finish_reason
    if not ctx.calls_tools:
        return AssistantMessage(content=text), reason
    content, calls = split_calls(text)
    if not calls:
        return AssistantMessage(content=text), reason
    tool_calls = [ResponseToolCall(id=call.id, function=ResponseFunctionCall(
        name=call.function.name, arguments=call.function.arguments)) for call in calls]
    return (AssistantMessage(content=content, tool_calls=tool_calls),
            "tool_calls" if reason == "stop" else reason)


def whole_response(ctx: ResponseContext, runs: list[ChoiceRun],
                   tokenizer: Tokenizer) -> dict[str, Any]:
    """The non-streamed answer, every choice complete."""
    usage = usage_of(runs, ctx.num_prompt_tokens)
    if ctx.chat:
        choices = []
        for run in runs:
            message, reason = assistant_message(ctx, run)
            choices.append(ChatCompletionChoice(
                index=run.index, message=message,
                finish_reason=reason,  # type: ignore[arg-type]
                logprobs=(LogprobsFormatter(tokenizer).chat(run.outcome.logprobs)
                          if ctx.wants_logprobs else None)))
        body = ChatCompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model,
                                      choices=choices, usage=usage).model_dump(mode="json")
    else:
        texts = [CompletionChoice(
            index=run.index, text=run.outcome.text,
            finish_reason=run.outcome.finish_reason,  # type: ignore[arg-type]
            logprobs=(LogprobsFormatter(tokenizer).completion(run.outcome.logprobs)
                      if ctx.wants_logprobs else None)) for run in runs]
        body = CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model,
                                  choices=texts, usage=usage).model_dump(mode="json")
    if ctx.request.pdserve_timings:
        body["pdserve_timings"] = timings_of(runs)
    return body


class StreamWriter:
    """The SSE chunks of one streamed response: per choice an opening chunk (chat), a chunk
    per delta, a finish chunk; then usage and timings when asked, and ``[DONE]``."""

    def __init__(self, ctx: ResponseContext, num_choices: int, tokenizer: Tokenizer) -> None:
        self.ctx = ctx
        include_usage = ctx.request.include_usage
        self.fmt: ChatStreamFormatter | CompletionStreamFormatter = (
            ChatStreamFormatter(ctx.request_id, ctx.model, ctx.created, include_usage)
            if ctx.chat else
            CompletionStreamFormatter(ctx.request_id, ctx.model, ctx.created, include_usage))
        # One per choice: the completions' text offsets count on within a choice.
        self.logprobs = ([LogprobsFormatter(tokenizer) for _ in range(num_choices)]
                         if ctx.wants_logprobs else None)
        # With tools: each choice's text split into content and tool-call deltas.
        self.tool_streams = ([ToolCallStream() for _ in range(num_choices)]
                             if ctx.calls_tools else None)

    def opening(self, index: int, first: GenerationDelta) -> str:
        head = self.fmt.first(index) if isinstance(self.fmt, ChatStreamFormatter) else ""
        return head + self.delta(index, first)

    def delta(self, index: int, delta: GenerationDelta) -> str:
        """A delta's chunk: its text, and its tokens' logprobs when asked for (a chunk of no
        text still carries those: the detokenizer may hold a partial character back)."""
        fmt = self.fmt
        if self.tool_streams is not None and isinstance(fmt, ChatStreamFormatter):
            content, calls = self.tool_streams[index].feed(delta.text)
            chunks = self._tool_chunks(index, calls)
            if content or (self.logprobs is not None and delta.logprobs):
                chunks = self._text_chunk(index, content, delta) + chunks
            return chunks
        return self._text_chunk(index, delta.text, delta)

    def _text_chunk(self, index: int, text: str, delta: GenerationDelta) -> str:
        fmt = self.fmt
        if self.logprobs is not None and delta.logprobs:
            lp = self.logprobs[index]
            if isinstance(fmt, ChatStreamFormatter):
                return fmt.delta(text, lp.chat(delta.logprobs), index)
            return fmt.delta(text, lp.completion(delta.logprobs), index)
        return fmt.delta(text, index=index) if text else ""

    def _tool_chunks(self, index: int, calls: list[ToolCallDelta]) -> str:
        if not calls or not isinstance(self.fmt, ChatStreamFormatter):
            return ""
        return self.fmt.tool_calls([call.as_openai() for call in calls], index)

    def finish(self, index: int, finish_reason: str) -> str:
        """What a choice held back, then its finish chunk (``tool_calls`` when it stopped
        after a call)."""
        out = ""
        if self.tool_streams is not None and isinstance(self.fmt, ChatStreamFormatter):
            stream = self.tool_streams[index]
            content, calls = stream.finish()
            if content:
                out += self.fmt.delta(content, index=index)
            out += self._tool_chunks(index, calls)
            if stream.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return out + self.fmt.finish(finish_reason, index)  # type: ignore[arg-type]

    def end(self, runs: list[ChoiceRun]) -> str:
        timings = timings_of(runs) if self.ctx.request.pdserve_timings else None
        return self.fmt.end(usage_of(runs, self.ctx.num_prompt_tokens), timings)
