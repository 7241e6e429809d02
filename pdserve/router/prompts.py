"""From a request body to a validated request and its prompt token ids, off the event loop.

Parsing, templating and tokenizing a large body takes long; the length check comes first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdserve.engine.errors import PromptTooLongError
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.errors import ModelNotFoundError
from pdserve.router.grammar_checks import GrammarChecks
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pdserve.router.structured import grammar_of
from pdserve.router.tools import template_tools

RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)


@dataclass(frozen=True)
class Prompt(Generic[RequestT]):
    request: RequestT
    token_ids: list[int]
    received_at: float  # time.monotonic() when building began
    build_ms: float  # parsing, templating and tokenizing


class PromptBuilder:
    """Builds prompts on a worker thread: the tokenizer releases the GIL while it works, so
    the ingress keeps answering other requests (and 429s) while one large body is read."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, served_model_name: str) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.served_model_name = served_model_name
        self.grammars = GrammarChecks()

    async def chat(self, body: bytes) -> Prompt[ChatCompletionRequest]:
        return await asyncio.to_thread(self._chat, body, time.monotonic())

    async def completion(self, body: bytes) -> Prompt[CompletionRequest]:
        return await asyncio.to_thread(self._completion, body, time.monotonic())

    def _chat(self, body: bytes, start: float) -> Prompt[ChatCompletionRequest]:
        req = self._parse(ChatCompletionRequest, body)
        self.grammars.check(grammar_of(req.response_format, req.tools, req.tool_choice))
        messages = req.template_messages()
        # tool_choice none: the model is not told of tools it may not call.
        tools = template_tools(req.tools) if req.calls_tools and req.tools else None
        self._check_fits(self.tokenizer.apply_chat_template(messages, tools=tools))
        # Content's special-token text becomes text tokens: content cannot forge a role.
        return self._prompt(req, self.tokenizer.encode_chat(messages, tools=tools), start)

    def _completion(self, body: bytes, start: float) -> Prompt[CompletionRequest]:
        req = self._parse(CompletionRequest, body)
        self.grammars.check(grammar_of(req.response_format))
        if isinstance(req.prompt, list):
            return self._prompt(req, list(req.prompt), start)
        return self._prompt(req, self._encode(req.prompt), start)

    def _parse(self, model_cls: type[RequestT], body: bytes) -> RequestT:
        req = parse_request(model_cls, body)
        if req.model != self.served_model_name:
            raise ModelNotFoundError(req.model, [self.served_model_name])
        return req

    @staticmethod
    def _prompt(req: RequestT, ids: list[int], start: float) -> Prompt[RequestT]:
        return Prompt(req, ids, start, (time.monotonic() - start) * 1000.0)

    def _encode(self, text: str) -> list[int]:
        self._check_fits(text)
        return self.tokenizer.encode(text)

    def _check_fits(self, text: str) -> None:
        """Refuses a text that cannot fit before spending the time to tokenize it."""
        at_least = self.tokenizer.min_num_tokens(text)
        if at_least >= self.max_model_len:
            raise PromptTooLongError(at_least, self.max_model_len,
                                     "(at least: a bound from its length, not tokenized); "
                                     "shorten the prompt")
