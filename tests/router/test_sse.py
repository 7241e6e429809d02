"""SSE framing: chunks parse back as JSON, streams end in [DONE], and the `openai` client reads
them (text, usage chunk, mid-stream errors) through a real FastAPI streaming response."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from pdserve.router.errors import ServiceUnavailableError
from pdserve.router.http_errors import install_error_handlers
from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    parse_request,
)
from pdserve.router.sse import (
    DONE_EVENT,
    SSE_MEDIA_TYPE,
    ChatStreamFormatter,
    CompletionStreamFormatter,
    error_event,
    split_sse_data,
    sse_event,
)

PIECES = ["Hel", "lo", ", wörld", " ✓"]


def chat_stream(fmt: ChatStreamFormatter, fail: bool = False) -> Iterator[str]:
    yield fmt.first()
    for piece in PIECES:
        yield fmt.delta(piece)
    if fail:
        yield error_event(ServiceUnavailableError("decode worker died"))
        yield DONE_EVENT
        return
    yield fmt.finish("stop") + fmt.end(Usage.from_counts(7, len(PIECES), num_cached_tokens=4))


def test_event_framing() -> None:
    assert sse_event({"a": "ü"}) == 'data: {"a":"ü"}\n\n'
    assert DONE_EVENT == "data: [DONE]\n\n"
    assert split_sse_data("data: 1\n\ndata:2\n\n: comment\n\ndata: [DONE]\n\n") == \
        ["1", "2", "[DONE]"]


def test_chat_stream_round_trip_with_usage() -> None:
    fmt = ChatStreamFormatter("chatcmpl-x", "tiny", 123, include_usage=True)
    body = "".join(chat_stream(fmt))
    assert body.endswith(DONE_EVENT) and body.count("data: ") == len(PIECES) + 4
    payloads = split_sse_data(body)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["id"] == "chatcmpl-x" and c["object"] == "chat.completion.chunk" and
               c["model"] == "tiny" and c["created"] == 123 for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "".join(PIECES)
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop"}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                                   "prompt_tokens_details": {"cached_tokens": 4}}
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI's shape with include_usage


def test_chat_stream_without_usage_has_no_usage_key() -> None:
    fmt = ChatStreamFormatter("chatcmpl-x", "tiny", 1)
    chunks = [json.loads(p) for p in split_sse_data("".join(chat_stream(fmt)))[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_stream_round_trip() -> None:
    fmt = CompletionStreamFormatter("cmpl-x", "tiny", 5, include_usage=True)
    body = "".join([fmt.delta(p) for p in PIECES]) + fmt.finish("length") + fmt.end(
        Usage.from_counts(3, 4))
    payloads = split_sse_data(body)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "".join(PIECES)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 7


def test_error_event_is_an_openai_error_body() -> None:
    [payload] = split_sse_data(error_event(ServiceUnavailableError("decode worker died")))
    assert json.loads(payload) == {"error": {
        "message": "decode worker died", "type": "server_error", "param": None,
        "code": "service_unavailable"}}


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        req = parse_request(ChatCompletionRequest, await request.body())
        fmt = ChatStreamFormatter("chatcmpl-t", req.model, 9, include_usage=req.include_usage)

        async def events() -> AsyncIterator[str]:
            for event in chat_stream(fmt, fail=req.user == "fail"):
                yield event

        return StreamingResponse(events(), media_type=SSE_MEDIA_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        req = parse_request(CompletionRequest, await request.body())
        fmt = CompletionStreamFormatter("cmpl-t", req.model, 9, include_usage=req.include_usage)
        body = [fmt.delta(p) for p in PIECES]
        body += [fmt.finish("stop") + fmt.end(Usage.from_counts(2, 4))]
        return StreamingResponse(iter(body), media_type=SSE_MEDIA_TYPE)

    return app


@pytest.fixture
def oai() -> Iterator[openai.OpenAI]:
    with TestClient(make_app()) as client:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused",
                            http_client=client, max_retries=0)


def test_openai_client_reads_the_chat_stream(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(PIECES)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (7, 4)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 4


def test_openai_client_raises_on_a_mid_stream_error(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, user="fail")
    received = []
    with pytest.raises(openai.APIError, match="decode worker died"):
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "".join(PIECES)  # everything before the error arrived


def test_openai_client_reads_the_completion_stream(oai: openai.OpenAI) -> None:
    stream = oai.completions.create(model="tiny", prompt="x", stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "".join(PIECES)
