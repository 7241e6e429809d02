"""Error handlers on a real FastAPI app: statuses, OpenAI error bodies, Retry-After, recovery.

Requests go through Starlette's TestClient (httpx), and through the `openai` client on top of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from pdserve.engine.errors import CheckpointError, PromptTooLongError
from pdserve.router.errors import (
    ModelNotFoundError,
    OverloadedError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from pdserve.router.http_errors import (
    INTERNAL_ERROR_MESSAGE,
    install_error_handlers,
    openai_error,
)
from pdserve.router.protocol import ChatCompletionRequest, parse_request

SERVED = "tiny"


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, object]:
        req = parse_request(ChatCompletionRequest, await request.body())
        if req.model != SERVED:
            raise ModelNotFoundError(req.model, [SERVED])
        if req.max_tokens is not None and req.max_tokens > 100:
            raise PromptTooLongError(30, 128, f"(plus max_tokens={req.max_tokens})")
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": SERVED,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @app.post("/typed")
    async def typed(req: ChatCompletionRequest) -> dict[str, str]:
        return {"model": req.model}

    failures = {
        "overloaded": OverloadedError(2.5, "decode queues are full"),
        "unavailable": ServiceUnavailableError("no decode replica is running"),
        "timeout": RequestTimeoutError(30, "handoff"),
        "checkpoint": CheckpointError("secret path /x/y is broken"),
        "boom": RuntimeError("internal detail"),
    }

    @app.get("/fail/{kind}")
    async def fail(kind: str) -> None:
        raise failures[kind]

    return app


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(make_app(), raise_server_exceptions=False) as test_client:
        yield test_client


def assert_openai_error(response: httpx.Response, status: int, type_: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["message"]
    return error


def test_invalid_json_is_400(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [')
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert str(error["message"]).startswith("request body is not valid JSON")


def test_missing_messages_names_the_param(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"model": SERVED})
    error = assert_openai_error(response, 400, "invalid_request_error")
    assert error["param"] == "messages"
    assert error["message"] == "messages: Field required"


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"messages": [{"role": "user", "content": "x"}], "model": SERVED, "max_tokens": 0},
     "max_tokens", "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": 3}], "model": SERVED},
     "messages.0.content", "content must be a string"),
    ({"messages": [{"role": "user", "content": "x"}], "model": SERVED, "n": 17},
     "n", "less than or equal to 16"),
    ({"messages": [{"role": "user", "content": "x"}], "model": SERVED, "temperature": "1"},
     "temperature", "valid number"),
    ({"messages": [{"role": "user", "content": "x"}], "model": SERVED, "max_token": 5},
     "max_token", "max_token: unrecognized request argument; remove it"),
    ({"messages": [{"role": "user", "content": "x"}], "model": SERVED,
      "stream_options": {"include_usage": True}},
     "stream_options", "only allowed with stream: true"),
])
def test_bad_fields_are_400_with_param(client: TestClient, body: dict[str, object], param: str,
                                       fragment: str) -> None:
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400,
                                "invalid_request_error")
    assert error["param"] == param and fragment in str(error["message"])


def test_body_that_is_not_an_object(client: TestClient) -> None:
    error = assert_openai_error(client.post("/v1/chat/completions", json=[1, 2]), 400,
                                "invalid_request_error")
    assert error["message"] == "request body must be a JSON object"


def test_fastapi_request_validation_is_mapped_too(client: TestClient) -> None:
    error = assert_openai_error(client.post("/typed", json={"model": SERVED, "messages": []}),
                                400, "invalid_request_error")
    assert error["param"] == "messages"
    error = assert_openai_error(client.post("/typed", content=b"{nope",
                                            headers={"content-type": "application/json"}),
                                400, "invalid_request_error")
    assert str(error["message"]).startswith("request body is not valid JSON")


def test_prompt_too_long_says_both_numbers(client: TestClient) -> None:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 101}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 400,
                                "invalid_request_error")
    assert error["code"] == "context_length_exceeded"
    assert "30 tokens" in str(error["message"]) and "128 tokens" in str(error["message"])


def test_unknown_model_is_404(client: TestClient) -> None:
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body), 404,
                                "invalid_request_error")
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'gpt-9'" in str(error["message"]) and "'tiny'" in str(error["message"])


def test_overload_is_429_with_retry_after(client: TestClient) -> None:
    response = client.get("/fail/overloaded")
    error = assert_openai_error(response, 429, "rate_limit_error")
    assert response.headers["Retry-After"] == "3"  # 2.5 s rounded up
    assert "decode queues are full" in str(error["message"])


@pytest.mark.parametrize(("kind", "status"), [("unavailable", 503), ("timeout", 504)])
def test_service_errors(client: TestClient, kind: str, status: int) -> None:
    assert_openai_error(client.get(f"/fail/{kind}"), status, "server_error")


@pytest.mark.parametrize("kind", ["boom", "checkpoint"])
def test_unexpected_errors_are_500_generic_and_logged(client: TestClient, kind: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="pdserve.router.http_errors"):
        response = client.get(f"/fail/{kind}")
    error = assert_openai_error(response, 500, "server_error")
    assert error["message"] == INTERNAL_ERROR_MESSAGE  # no internals leak to clients
    assert any(f"GET /fail/{kind}" in r.getMessage() and r.exc_info for r in caplog.records)


def test_unknown_route_keeps_its_status_in_openai_shape(client: TestClient) -> None:
    assert_openai_error(client.get("/v1/nothing"), 404, "invalid_request_error")
    assert_openai_error(client.get("/v1/chat/completions"), 405, "invalid_request_error")


def test_server_keeps_answering_after_errors(client: TestClient) -> None:
    for kind in ("boom", "overloaded", "checkpoint"):
        client.get(f"/fail/{kind}")
    client.post("/v1/chat/completions", content=b"{")
    body = {"model": SERVED, "messages": [{"role": "user", "content": "x"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_openai_client_raises_the_matching_exceptions(client: TestClient) -> None:
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client,
                        max_retries=0)
    messages = [{"role": "user", "content": "x"}]
    assert oai.chat.completions.create(model=SERVED, messages=messages).choices[0].message.content \
        == "ok"  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError) as not_found:
        oai.chat.completions.create(model="gpt-9", messages=messages)  # type: ignore[arg-type]
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=SERVED, messages=messages, n=0)  # type: ignore[arg-type]
    assert "greater than or equal to 1" in bad.value.message


def test_ray_wrapped_errors_are_unwrapped() -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    wrapped = ray_exceptions.RayTaskError(
        "prefill", "Traceback (most recent call last): ...",
        PromptTooLongError(5000, 4096)).as_instanceof_cause()
    answer = openai_error(wrapped)
    assert answer.status == 400
    assert answer.body["error"]["message"].startswith("prompt has 5000 tokens")
    assert "Traceback" not in answer.body["error"]["message"]


def test_ray_serve_backpressure_is_429() -> None:
    serve_exceptions = pytest.importorskip("ray.serve.exceptions")
    answer = openai_error(serve_exceptions.BackPressureError(num_queued_requests=10,
                                                              max_queued_requests=10))
    assert (answer.status, answer.headers) == (429, {"Retry-After": "1"})


def test_foreign_errors_answer_a_public_message_and_log_the_detail(
        caplog: pytest.LogCaptureFixture) -> None:
    from ray.exceptions import RayActorError

    detail = "The actor died: pid=4242, ip=10.1.2.3, actor_id=abcdef0123456789abcd, namespace=x"
    with caplog.at_level(logging.WARNING, logger="pdserve.router.http_errors"):
        answer = openai_error(RayActorError(error_msg=detail), "POST /v1/completions")
    assert answer.status == 503
    assert answer.body["error"]["message"] == "a worker failed while serving this request; retry it"
    assert [r.getMessage().count(detail) for r in caplog.records] == [1]
    # pdserve's own errors are written for the client and keep their message.
    own = openai_error(ServiceUnavailableError("no decode replica is running"))
    assert own.body["error"]["message"] == "no decode replica is running"


def test_a_dead_engine_answers_503_and_keeps_its_cause_in_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    from pdserve.engine.errors import EngineDeadError

    crash = "engine thread died: CollectiveError('all-reduce failed: [10.1.2.3]:4242 closed')"
    with caplog.at_level(logging.WARNING, logger="pdserve.router.http_errors"):
        answer = openai_error(EngineDeadError(crash), "POST /v1/completions")
    assert answer.status == 503
    assert answer.body["error"] == {
        "message": "the worker serving this request stopped; retry it", "type": "server_error",
        "param": None, "code": "service_unavailable"}
    assert [r.getMessage().count(crash) for r in caplog.records] == [1]
