"""OpenAI-compatible request schemas (chat and text completions) and their engine parameters.

Unknown top-level fields are refused, as OpenAI refuses them; known fields of the wrong type too.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pdserve.engine.errors import InvalidRequestError, PromptTooLongError
from pdserve.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MIN_SEED,
    SamplingParams,
)
from pdserve.router.protocol_responses import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FinishReason,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_request_id,
    unix_time,
)
from pdserve.router.structured import ResponseFormat, grammar_of
from pdserve.router.tools import (
    NamedToolChoice,
    ToolCall,
    ToolChoice,
    ToolDefinition,
    template_tool_calls,
)

__all__ = [
    "AssistantMessage", "ChatCompletionChoice", "ChatCompletionChunk", "ChatCompletionChunkChoice",
    "ChatCompletionRequest", "ChatCompletionResponse", "ChatMessage", "ChoiceLogprobs",
    "CompletionChoice", "CompletionLogprobs", "CompletionRequest", "CompletionResponse",
    "DeltaMessage", "FinishReason", "ModelCard", "ModelList", "PromptTokensDetails",
    "StreamOptions", "TextContentPart", "TokenLogprob", "TopLogprob", "Usage", "new_request_id",
    "parse_request", "resolve_max_tokens", "to_sampling_params", "unix_time",
]

MAX_STOP_SEQUENCES = 4
# Choices per request: each is a whole generation (the admission gate counts all of them).
MAX_CHOICES = 16
# OpenAI's default for legacy completions without max_tokens; chat defaults to all room left.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Legacy completions allow at most 5 alternatives per token.
MAX_COMPLETION_LOGPROBS = 5


class _Request(BaseModel):
    # strict: "5" is not 5 and 1 is not true. Parts of a request (messages, stream_options)
    # ignore keys they do not know: clients echo back what earlier answers carried.
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None  # None: an assistant's calls only
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, as answers carry them
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got type {kind!r}")
        elif not isinstance(value, str):
            raise ValueError("content must be a string or a list of {type: 'text', text} parts")
        return value

    @model_validator(mode="after")
    def _content_unless_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's "
                             "message with tool_calls may omit it)")
        return self

    def text(self) -> str:
        """The message's text; several text parts are joined by newlines."""
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template wants it: role, content and any calls."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields chat and text completions share. A top-level field this server does not know
    is refused (400 naming it), as OpenAI does: a misspelt `max_token` would otherwise be
    dropped without a word."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str = Field(description="Served model name; see GET /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass. Default 1.")
    top_k: int | None = Field(None, ge=-1, description="Extension: keep the k likeliest tokens; "
                              "0 or -1: off.")
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED, description="Reproducible sampling.")
    stop: list[str] | None = Field(None, description="Up to 4 stop strings (or one string).")
    stop_token_ids: list[int] | None = Field(None, description="Extension: stop on these ids.")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate for the prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past end-of-sequence.")
    user: str | None = Field(None, description="Accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored (nothing is stored).")
    service_tier: str | None = Field(None, description="Accepted and ignored.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted; a forced call "
                                             "(tool_choice required or named) is one call.")
    response_format: ResponseFormat | None = Field(
        None, description="text (default), json_object, or json_schema: the answer is "
        "constrained to JSON (valid for the schema) unless cut by max_tokens.")
    presence_penalty: float | None = Field(
        None, ge=-MAX_PENALTY, le=MAX_PENALTY,
        description="Lowers the logit of every token generated so far, once.")
    frequency_penalty: float | None = Field(
        None, ge=-MAX_PENALTY, le=MAX_PENALTY,
        description="Lowers the logit of every token generated so far, per occurrence.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, -100..100.")
    pdserve_timings: bool = Field(
        False, description="Extension: return each choice's server-side stage timings "
        "(queue, prefill, handoff, first token, ...) as `pdserve_timings`, in the response or "
        "in a last chunk before [DONE].")

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, value: StreamOptions | None,
                               info: ValidationInfo) -> StreamOptions | None:
        # `stream` is declared first, so it is already in info.data when valid.
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            if len(value) > MAX_STOP_SEQUENCES:
                raise ValueError(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, "
                                 f"got {len(value)}")
            if any(s == "" for s in value):
                raise ValueError("stop sequences must not be empty strings")
        elif value is not None:
            raise ValueError("stop must be a string or a list of strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids_and_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                             f"got {len(value)}")
        for key, bias in value.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids (digits), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias for token {key} must be in "
                                 f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Overrides max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may "
                                               "call; shown to it by the chat template.")
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (default with tools), required, or {type: function, "
        "function: {name}}: required and a named function force a call valid for its schema.")

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if not names:
                raise ValueError("tool_choice other than none/auto needs tools")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise ValueError(f"tool_choice names function {choice.function.name!r}, which "
                                 f"is not among the tools {names}")
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # `logprobs` is declared first, so it is already in info.data when valid.
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs: true")
        return value

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template wants it: ``[{role, content, ...}]``."""
        return [m.template_message() for m in self.messages]

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: a text prompt, or one list of token ids."""

    prompt: str | list[int] = Field(description="Text, or token ids (one prompt only).")
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = Field(False, description="Unsupported unless false.")
    best_of: int | None = Field(None, description="Unsupported unless 1.")
    suffix: str | None = Field(None, description="Unsupported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not isinstance(value, list):
            raise ValueError("prompt must be a string or a list of token ids")
        if not value:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, (str, list)) for x in value):
            raise ValueError("batched prompts are not supported; send one request per prompt")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value):
            raise ValueError("prompt token ids must be non-negative integers")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; omit it or send false")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("best_of other than 1 is not supported; omit it")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported; omit it")
        return value

    def requested_logprobs(self) -> int | None:
        return self.logprobs


RequestT = TypeVar("RequestT", bound=_SamplingRequest)


def parse_request(model_cls: type[RequestT], body: bytes | str) -> RequestT:
    """Validate a raw JSON body; raises pydantic's ValidationError (400 via http_errors)."""
    return model_cls.model_validate_json(body)


def resolve_max_tokens(req: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int,
                       max_model_len: int) -> int:
    """How many tokens the request may generate, checked against the model's length.

    Without a client limit: chat gets all the room the prompt leaves, completions get
    OpenAI's default of 16 (capped by that room). Raises PromptTooLongError when the prompt
    leaves no room, InvalidRequestError when the requested limit does not fit.
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise PromptTooLongError(num_prompt_tokens, max_model_len,
                                 "(at least one output token must fit); shorten the prompt")
    requested = req.requested_max_tokens()
    if requested is None:
        return room if isinstance(req, ChatCompletionRequest) else min(
            DEFAULT_COMPLETION_MAX_TOKENS, room)
    if requested > room:
        name = ("max_completion_tokens" if isinstance(req, ChatCompletionRequest)
                and req.max_completion_tokens is not None else "max_tokens")
        raise InvalidRequestError(
            f"{name}={requested} plus the prompt's {num_prompt_tokens} tokens exceeds the "
            f"model's maximum length of {max_model_len} tokens; set {name} to at most {room}")
    return requested


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest,
                       default_max_tokens: int) -> SamplingParams:
    """The engine's sampling parameters for a validated request.

    ``default_max_tokens`` applies when the client gave no limit (the ingress passes what the
    model's length leaves after the prompt); the model-limit check itself happens there.
    """
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return SamplingParams(
        max_tokens=req.requested_max_tokens() or default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=req.requested_logprobs(),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=tuple((int(key), bias) for key, bias in (req.logit_bias or {}).items()),
        grammar=grammar_of(req.response_format, getattr(req, "tools", None),
                           getattr(req, "tool_choice", None)),
    )
