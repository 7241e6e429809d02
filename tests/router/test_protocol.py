"""OpenAI request validation and the conversion of requests into engine sampling parameters.

Requests arrive as JSON bytes, as the ingress receives them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
    new_request_id,
    parse_request,
    resolve_max_tokens,
    to_sampling_params,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def errors_of(cls: type[ChatCompletionRequest | CompletionRequest],
              body: dict[str, Any] | str) -> list[tuple[tuple[Any, ...], str]]:
    raw = body if isinstance(body, str) else json.dumps(body)
    with pytest.raises(ValidationError) as info:
        parse_request(cls, raw)
    return [(tuple(e["loc"]), e["msg"]) for e in info.value.errors()]


def test_minimal_chat_request_and_defaults() -> None:
    req = parse_request(ChatCompletionRequest, json.dumps(chat()))
    assert req.template_messages() == [{"role": "user", "content": "hi"}]
    assert (req.n, req.stream, req.include_usage) == (1, False, False)
    params = to_sampling_params(req, default_max_tokens=77)
    assert params == SamplingParams(max_tokens=77, temperature=1.0, top_p=1.0)


def test_openai_fields_that_change_nothing_are_accepted() -> None:
    req = parse_request(ChatCompletionRequest, json.dumps(chat(
        metadata={"a": "1"}, store=False, service_tier="auto", user="u",
        parallel_tool_calls=False, response_format={"type": "text"})))
    assert to_sampling_params(req, 10) == to_sampling_params(
        parse_request(ChatCompletionRequest, json.dumps(chat())), 10)


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_unknown_top_level_fields_are_refused_by_name(cls: type[Any]) -> None:
    body = chat(max_token=5) if cls is ChatCompletionRequest else {"model": "m", "prompt": "x",
                                                                   "max_token": 5}
    [(loc, msg)] = errors_of(cls, body)
    assert loc == ("max_token",) and "Extra inputs" in msg
    # Parts of a request keep ignoring keys they do not know (clients echo answers back).
    parse_request(ChatCompletionRequest, json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi", "refusal": None}]}))


def test_text_parts_are_joined_and_other_parts_refused() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    req = parse_request(ChatCompletionRequest, json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": parts}]}))
    assert req.template_messages()[1] == {"role": "user", "content": "one\ntwo"}
    [(loc, msg)] = errors_of(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert loc == ("messages", 0, "content") and "only text content parts" in msg


def test_all_sampling_fields_reach_the_engine() -> None:
    req = parse_request(ChatCompletionRequest, json.dumps(chat(
        max_tokens=5, max_completion_tokens=9, temperature=0, top_p=0.5, top_k=40, seed=7,
        stop=["\n\n", "END"], stop_token_ids=[2], ignore_eos=True, logprobs=True,
        top_logprobs=3, user="u", presence_penalty=0.5, frequency_penalty=-1.5,
        logit_bias={"17": -100, "5": 2.5})))
    params = to_sampling_params(req, default_max_tokens=100)
    assert params == SamplingParams(max_tokens=9, temperature=0.0, top_p=0.5, top_k=40, seed=7,
                                    stop=("\n\n", "END"), stop_token_ids=(2,), ignore_eos=True,
                                    logprobs=3, presence_penalty=0.5, frequency_penalty=-1.5,
                                    logit_bias=((17, -100.0), (5, 2.5)))
    assert params.is_greedy


def test_single_stop_string_and_vllm_style_top_k_off() -> None:
    req = parse_request(ChatCompletionRequest, json.dumps(chat(stop="###", top_k=-1)))
    params = to_sampling_params(req, 10)
    assert (params.stop, params.top_k) == (("###",), 0)


def test_stream_options_need_a_stream() -> None:
    req = parse_request(ChatCompletionRequest, json.dumps(
        chat(stream=True, stream_options={"include_usage": True})))
    assert req.include_usage
    for body in (chat(stream_options={"include_usage": True}),
                 chat(stream=False, stream_options={"include_usage": False})):
        [(loc, msg)] = errors_of(ChatCompletionRequest, body)
        assert loc == ("stream_options",) and "only allowed with stream: true" in msg


@pytest.mark.parametrize(("body", "loc", "fragment"), [
    ({"model": "m"}, ("messages",), "Field required"),
    ({"messages": USER}, ("model",), "Field required"),
    (chat(messages=[]), ("messages",), "at least 1 item"),
    (chat(messages="hi"), ("messages",), "valid array"),
    (chat(messages=[{"role": "robot", "content": "x"}]), ("messages", 0, "role"), "'system'"),
    (chat(messages=[{"role": "user", "content": 5}]), ("messages", 0, "content"),
     "content must be a string"),
    (chat(max_tokens=0), ("max_tokens",), "greater than or equal to 1"),
    (chat(max_tokens=-3), ("max_tokens",), "greater than or equal to 1"),
    (chat(max_completion_tokens=0), ("max_completion_tokens",), "greater than or equal to 1"),
    (chat(max_tokens="5"), ("max_tokens",), "valid integer"),
    (chat(max_tokens=2.5), ("max_tokens",), "valid integer"),
    (chat(temperature=2.5), ("temperature",), "less than or equal to 2"),
    (chat(temperature="hot"), ("temperature",), "valid number"),
    (chat(top_p=0), ("top_p",), "greater than 0"),
    (chat(stream="yes"), ("stream",), "valid boolean"),
    (chat(n=17), ("n",), "less than or equal to 16"),
    (chat(n=0), ("n",), "greater than or equal to 1"),
    (chat(stop=["a", "b", "c", "d", "e"]), ("stop",), "at most 4 sequences, got 5"),
    (chat(stop=[""]), ("stop",), "must not be empty"),
    (chat(stop=7), ("stop",), "stop must be a string or a list"),
    (chat(stop=["a", 1]), ("stop", 1), "valid string"),
    (chat(top_logprobs=2), ("top_logprobs",), "requires logprobs: true"),
    (chat(logprobs=True, top_logprobs=21), ("top_logprobs",), "less than or equal to 20"),
    (chat(presence_penalty=2.5), ("presence_penalty",), "less than or equal to 2"),
    (chat(frequency_penalty=-3), ("frequency_penalty",), "greater than or equal to -2"),
    (chat(logit_bias={"x1": 5}), ("logit_bias",), "keys are token ids"),
    (chat(logit_bias={"1": 101}), ("logit_bias",), "must be in [-100.0, 100.0]"),
    (chat(logit_bias={"1": "big"}), ("logit_bias", "1"), "valid number"),
    (chat(tools=[{"type": "function"}]), ("tools", 0, "function"), "Field required"),
    (chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
     ("tools", 0, "function", "name"), "must be 1-64 letters"),
    (chat(tool_choice="required"), (), "needs tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), (), "not among"),
    (chat(messages=[{"role": "user"}]), ("messages", 0), "needs content"),
    (chat(seed=2**70), ("seed",), "less than or equal to"),
    (chat(response_format={"type": "xml"}), ("response_format", "type"),
     "'text', 'json_object' or 'json_schema'"),
    (chat(response_format={"type": "json_schema"}), ("response_format",),
     "needs json_schema exactly when"),
    (chat(response_format={"type": "json_schema", "json_schema": {}}),
     ("response_format", "json_schema", "name"), "Field required"),
])
def test_chat_validation_names_the_field(body: dict[str, Any], loc: tuple[Any, ...],
                                         fragment: str) -> None:
    errors = errors_of(ChatCompletionRequest, body)
    assert any(e_loc == loc and fragment in msg for e_loc, msg in errors), errors


def test_malformed_json_is_a_validation_error() -> None:
    [(loc, msg)] = errors_of(ChatCompletionRequest, '{"model": "m", "messages": [')
    assert loc == () and msg.startswith("Invalid JSON")


def test_completion_prompt_forms() -> None:
    req = parse_request(CompletionRequest,
                        json.dumps({"model": "m", "prompt": "Once", "logprobs": 2}))
    assert to_sampling_params(req, 16).logprobs == 2
    req = parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": [1, 2, 3]}))
    assert req.prompt == [1, 2, 3]


@pytest.mark.parametrize(("prompt", "fragment"), [
    ("", "must not be empty"), ([], "must not be empty"), (["a", "b"], "batched prompts"),
    ([[1, 2], [3]], "batched prompts"), ([1, -2], "non-negative integers"),
    ([1, "x"], "non-negative integers"), ([True], "non-negative integers"),
    (5, "string or a list of token ids"), (None, "string or a list of token ids"),
])
def test_completion_prompt_validation(prompt: Any, fragment: str) -> None:
    errors = errors_of(CompletionRequest, {"model": "m", "prompt": prompt})
    assert any(loc == ("prompt",) and fragment in msg for loc, msg in errors), errors


@pytest.mark.parametrize(("field", "value"), [("echo", True), ("best_of", 3), ("suffix", "x"),
                                              ("logprobs", 6), ("n", 17)])
def test_completion_unsupported_fields(field: str, value: Any) -> None:
    errors = errors_of(CompletionRequest, {"model": "m", "prompt": "x", field: value})
    assert [loc for loc, _ in errors] == [(field,)]


def test_engine_checks_still_apply_after_conversion() -> None:
    # The HTTP layer lets through what SamplingParams then refuses with its own message.
    req = parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": "x",
                                                       "stop_token_ids": [-1]}))
    from pdserve.engine.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        to_sampling_params(req, 16)


def test_response_helpers() -> None:
    usage = Usage.from_counts(10, 5, num_cached_tokens=8)
    assert usage.model_dump() == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                                  "prompt_tokens_details": {"cached_tokens": 8}}
    assert new_request_id("chat").startswith("chatcmpl-")
    assert new_request_id("completion").startswith("cmpl-")
    assert new_request_id("chat") != new_request_id("chat")
    listing = ModelList(data=[ModelCard(id="m", created=1, max_model_len=2048)])
    assert listing.model_dump()["data"][0] == {"id": "m", "object": "model", "created": 1,
                                               "owned_by": "pdserve", "max_model_len": 2048}


def test_resolve_max_tokens_against_the_model_length() -> None:
    chat_req = parse_request(ChatCompletionRequest, json.dumps(chat()))
    assert resolve_max_tokens(chat_req, num_prompt_tokens=100, max_model_len=128) == 28
    completion = parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": "x"}))
    assert resolve_max_tokens(completion, 100, 128) == 16
    assert resolve_max_tokens(completion, 120, 128) == 8
    limited = parse_request(ChatCompletionRequest, json.dumps(chat(max_completion_tokens=28)))
    assert resolve_max_tokens(limited, 100, 128) == 28


def test_resolve_max_tokens_refusals_say_both_numbers() -> None:
    from pdserve.engine.errors import InvalidRequestError, PromptTooLongError
    req = parse_request(ChatCompletionRequest, json.dumps(chat(max_tokens=29)))
    with pytest.raises(InvalidRequestError, match=r"max_tokens=29 plus the prompt's 100 tokens "
                       r"exceeds the model's maximum length of 128 tokens; set max_tokens to "
                       r"at most 28"):
        resolve_max_tokens(req, 100, 128)
    with pytest.raises(PromptTooLongError, match=r"prompt has 128 tokens but the model's maximum "
                       r"length is 128 tokens"):
        resolve_max_tokens(req, 128, 128)
