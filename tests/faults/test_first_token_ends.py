"""A request whose first token already ends it, on every path: max_tokens 1, or EOS or a
stop token sampled first. On the disaggregated path that token comes from the prefill
worker, so the decode worker receives KV for a request that is already over."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPT_LEN = 100  # above min_disaggregated_prompt_tokens: the disaggregated path


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, str]) -> LLMEngine:
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))


def prompt_ids(engine: LLMEngine) -> list[int]:
    ids = engine.tokenizer.encode("The lighthouse keeper counted the ships at dawn. " * 20)
    return ids[:PROMPT_LEN]


def complete(app_url: str, body: dict, stream: bool) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a one-choice completion."""
    body = {"model": "tiny", **body, "stream": stream}
    if not stream:
        r = httpx.post(f"{app_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()
        return (data["choices"][0]["text"], data["choices"][0]["finish_reason"],
                data["usage"]["completion_tokens"])
    body["stream_options"] = {"include_usage": True}
    text, finish, usage = "", None, None
    with httpx.stream("POST", f"{app_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            usage = chunk.get("usage") or usage
    assert usage is not None
    return text, finish, usage["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("app", ["disagg", "colo"])
def test_max_tokens_1(served_apps: ServedApps, engine: LLMEngine, app: str,
                      stream: bool) -> None:
    ids = prompt_ids(engine)
    [want] = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    text, finish, num = complete(served_apps.url(app), body, stream)
    assert (text, finish, num) == (engine.tokenizer.decode(want), "length", 1)
    served_apps.wait_all_free(app)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("app", ["disagg", "colo"])
def test_eos_sampled_first(served_apps: ServedApps, engine: LLMEngine, app: str,
                           stream: bool) -> None:
    ids = prompt_ids(engine)
    eos = engine.tokenizer.eos_token_ids[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((eos, 100.0),))
    [want] = engine.generate([ids], params)
    assert want == [eos]
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "logit_bias": {str(eos): 100}}
    text, finish, num = complete(served_apps.url(app), body, stream)
    assert (text, finish, num) == ("", "stop", 1)
    served_apps.wait_all_free(app)


@pytest.mark.parametrize("app", ["disagg", "colo"])
def test_stop_token_sampled_first(served_apps: ServedApps, engine: LLMEngine,
                                  app: str) -> None:
    ids = prompt_ids(engine)
    [first] = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "stop_token_ids": first}
    assert complete(served_apps.url(app), body, stream=False)[1:] == ("stop", 1)
    served_apps.wait_all_free(app)
