"""Structured outputs and tool calls through the `openai` client, on the disaggregated and the
colocated app: JSON valid for its schema (streamed or not, n > 1, parse with a pydantic model),
forced tool calls valid for their function, tool results in the next turn, and a 400 for a
schema the grammar engine refuses.

The tiny checkpoint's weights are random: without a grammar its answers are never JSON.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.schemas import SCHEMAS, TIME_TOOL, WEATHER_TOOL

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APPS = ["disagg", "colo"]
MAX_TOKENS = 300  # the schemas' answers take at most ~70 tokens: each must end by itself
# Long enough (> min_disaggregated_prompt_tokens) for the disaggregated app's prefill role.
SYSTEM = ("You answer with JSON only, following the schema you are given, in every turn. "
          "Keep strings short.")


def client(apps: ServedApps, app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{apps.url(app)}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def conversation(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def ask(c: openai.OpenAI, name: str, stream: bool, seed: int) -> tuple[str, str | None, str]:
    """(text, finish reason, path) of one answer constrained to schema ``name``."""
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=conversation(f"Describe {name}."), max_tokens=MAX_TOKENS,
        seed=seed, response_format=json_schema_format(name, SCHEMAS[name]),
        extra_body={"pdserve_timings": True})
    if not stream:
        resp = c.chat.completions.create(**kwargs)
        path = (resp.model_extra or {})["pdserve_timings"][0]["path"]
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason, path
    text, reason, path = "", None, ""
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        elif chunk.model_extra and "pdserve_timings" in chunk.model_extra:
            path = chunk.model_extra["pdserve_timings"][0]["path"]
    return text, reason, path


@pytest.mark.parametrize("app", APPS)
def test_every_schema_answer_validates(served_apps: ServedApps, app: str) -> None:
    c = client(served_apps, app)
    jobs = [(name, stream, seed) for seed, name in enumerate(SCHEMAS) for stream in (False, True)]
    with ThreadPoolExecutor(4) as pool:  # the colocated app admits 4 at once
        answers = list(pool.map(lambda job: ask(c, *job), jobs))
    for (name, stream, _), (text, reason, path) in zip(jobs, answers, strict=True):
        assert reason == "stop", (name, stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert path == ("colocated" if app == "colo" else "disaggregated"), (name, path)


def test_a_short_prompt_prefilled_on_decode_follows_the_grammar(served_apps: ServedApps) -> None:
    resp = client(served_apps, "disagg").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS,
        response_format=json_schema_format("person", SCHEMAS["person"]), n=2,
        extra_body={"pdserve_timings": True})
    assert {t["path"] for t in (resp.model_extra or {})["pdserve_timings"]} == {"local_prefill"}
    for choice in resp.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMAS["person"])


@pytest.mark.parametrize("app", APPS)
def test_free_text_is_not_json(served_apps: ServedApps, app: str) -> None:
    resp = client(served_apps, app).chat.completions.create(
        model="tiny", messages=conversation("Describe person."), max_tokens=40, seed=1, n=3)
    for choice in resp.choices:
        with pytest.raises(json.JSONDecodeError):
            json.loads(choice.message.content or "")


@pytest.mark.parametrize("app", APPS)
def test_json_object_on_chat_and_completions(served_apps: ServedApps, app: str) -> None:
    c = client(served_apps, app)
    resp = c.chat.completions.create(model="tiny", messages=conversation("Anything."), n=2,
                                     response_format={"type": "json_object"},
                                     max_tokens=MAX_TOKENS)
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content or ""), dict)
    texts = {0: "", 1: ""}
    for chunk in c.completions.create(model="tiny", prompt=SYSTEM, n=2, stream=True,
                                      max_tokens=MAX_TOKENS,
                                      extra_body={"response_format": json_schema_format(
                                          "person", SCHEMAS["person"])}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMAS["person"])


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


@pytest.mark.parametrize("app", APPS)
def test_parse_returns_a_pydantic_object(served_apps: ServedApps, app: str) -> None:
    completion = client(served_apps, app).beta.chat.completions.parse(
        model="tiny", messages=conversation("Who are you?"), response_format=Person,
        max_tokens=MAX_TOKENS, seed=4)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person) and isinstance(parsed.address, Address)


@pytest.mark.parametrize("app", APPS)
def test_a_schema_that_cannot_compile_is_a_400(served_apps: ServedApps, app: str) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot be used for constrained output"):
        client(served_apps, app).chat.completions.create(
            model="tiny", messages=conversation("x"), response_format=json_schema_format(
                "bad", {"type": "object", "properties": {"a": {"type": "complex"}}}))
    served_apps.wait_all_free(app)


def _arguments_schema(name: str) -> dict[str, Any]:
    tool = {t["function"]["name"]: t for t in (WEATHER_TOOL, TIME_TOOL)}[name]
    return tool["function"]["parameters"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_validate(served_apps: ServedApps, app: str, choice: str) -> None:
    c = client(served_apps, app)
    tool_choice: Any = choice if choice == "required" else {
        "type": "function", "function": {"name": "get_time"}}
    kwargs: dict[str, Any] = dict(model="tiny", messages=conversation("Weather or time?"),
                                  tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice,
                                  max_tokens=MAX_TOKENS)
    for seed in range(3):
        resp = c.chat.completions.create(**kwargs, seed=seed)
        choice_ = resp.choices[0]
        assert choice_.finish_reason == "tool_calls"
        [call] = choice_.message.tool_calls or []
        assert call.id.startswith("call_") and call.type == "function"
        assert choice == "required" or call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments),
                            _arguments_schema(call.function.name))
    deltas, reasons, content = [], [], ""
    for chunk in c.chat.completions.create(**kwargs, seed=7, stream=True):
        delta = chunk.choices[0].delta
        deltas += delta.tool_calls or []
        content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name
    assert all(d.index == 0 and d.id is None for d in deltas[1:]) and not content
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), _arguments_schema(deltas[0].function.name))
    assert reasons[-1] == "tool_calls"


@pytest.mark.parametrize("app", APPS)
def test_tool_results_in_the_next_turn(served_apps: ServedApps, app: str) -> None:
    c = client(served_apps, app)
    messages = conversation("What is the weather in Oslo?")
    first = c.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                      tool_choice="required", max_tokens=MAX_TOKENS)
    message = first.choices[0].message
    [call] = message.tool_calls or []
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": -3}'}]
    second = c.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
        max_tokens=MAX_TOKENS, response_format=json_schema_format("reply", SCHEMAS["enum_only"]))
    jsonschema.validate(json.loads(second.choices[0].message.content or ""),
                        SCHEMAS["enum_only"])
    auto = c.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL],
                                     max_tokens=8)
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_recompute_after_a_failed_handoff_keeps_the_json_valid(
        served_apps: ServedApps, tiny_checkpoints: dict[str, str]) -> None:
    """Prefill sampled the first token under the grammar; decode never got the KV, recomputes
    the prompt with that token and continues the same grammar from it."""
    from tests.support.failing_handoff import failing_handoff_app

    with failing_handoff_app(served_apps, tiny_checkpoints["llama"], "json_fallback") as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        names = ["nested_address", "array_of_objects", "ref_definitions", "mixed_order"]
        for i, name in enumerate(names):
            text, reason, path = ask(c, name, stream=i % 2 == 1, seed=11)
            assert path == "recompute_fallback" and reason == "stop", (name, path, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        served_apps.wait_all_free("json_fallback")
