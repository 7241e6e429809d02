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
    Usage,
)
from pdserve.router.sse import ChatStreamFormatter, CompletionStreamFormatter

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


def whole_response(ctx: ResponseContext, runs: list[ChoiceRun],
                   tokenizer: Tokenizer) -> dict[str, Any]:
    """The non-streamed answer, every choice complete."""
    usage = usage_of(runs, ctx.num_prompt_tokens)
    if ctx.chat:
        choices = [ChatCompletionChoice(
            index=run.index, message=AssistantMessage(content=run.outcome.text),
            finish_reason=run.outcome.finish_reason,  # type: ignore[arg-type]
            logprobs=(LogprobsFormatter(tokenizer).chat(run.outcome.logprobs)
                      if ctx.wants_logprobs else None)) for run in runs]
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

    def opening(self, index: int, first: GenerationDelta) -> str:
        head = self.fmt.first(index) if isinstance(self.fmt, ChatStreamFormatter) else ""
        return head + self.delta(index, first)

    def delta(self, index: int, delta: GenerationDelta) -> str:
        """A delta's chunk: its text, and its tokens' logprobs when asked for (a chunk of no
        text still carries those: the detokenizer may hold a partial character back)."""
        fmt = self.fmt
        if self.logprobs is not None and delta.logprobs:
            lp = self.logprobs[index]
            if isinstance(fmt, ChatStreamFormatter):
                return fmt.delta(delta.text, lp.chat(delta.logprobs), index)
            return fmt.delta(delta.text, lp.completion(delta.logprobs), index)
        return fmt.delta(delta.text, index=index) if delta.text else ""

    def finish(self, index: int, finish_reason: str) -> str:
        return self.fmt.finish(finish_reason, index)  # type: ignore[arg-type]

    def end(self, runs: list[ChoiceRun]) -> str:
        timings = timings_of(runs) if self.ctx.request.pdserve_timings else None
        return self.fmt.end(usage_of(runs, self.ctx.num_prompt_tokens), timings)
