"""Streams whose tokens cross from decode in batches (``router.stream_interval_ms``): the same
text as unbatched streams, whole responses and the engine, in fewer chunks; logprobs and n
choices still line up; a client leaving mid-stream still frees every block."""

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

MAX_TOKENS = 48
PROMPT = "Write about the lighthouse keeper and the ships he counted, at length. " * 4


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, str]) -> LLMEngine:
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=256))


def stream_chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("app", ["batched", "disagg"])
def test_batched_and_unbatched_streams_equal_the_engine_and_the_whole_response(
        served_apps: ServedApps, engine: LLMEngine, app: str) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    [want] = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    body = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    url = served_apps.url(app)
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    chunks = stream_chunks(url, body)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    # A chunk ending inside a character would show U+FFFD where the whole text has the
    # character: the joined chunks would differ from the whole response.
    assert "".join(texts) == whole["choices"][0]["text"] == engine.tokenizer.decode(want)
    if app == "batched":  # the tiny model steps in a few ms: 50 ms gather several tokens
        assert len([t for t in texts if t]) < MAX_TOKENS / 2
    served_apps.wait_all_free(app)


def test_batched_logprobs_and_choices_line_up_by_index(served_apps: ServedApps,
                                                       engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    body = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 3, "n": 2, "logprobs": 1, "ignore_eos": True}
    whole = httpx.post(f"{served_apps.url('batched')}/v1/completions", json=body,
                       timeout=120).json()
    texts, tokens = ["", ""], [[], []]
    for chunk in stream_chunks(served_apps.url("batched"), body):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["logprobs"]:
                tokens[choice["index"]] += choice["logprobs"]["tokens"]
    for choice in whole["choices"]:
        i = choice["index"]
        assert texts[i] == choice["text"]
        assert tokens[i] == choice["logprobs"]["tokens"]
        assert len(tokens[i]) == MAX_TOKENS
    served_apps.wait_all_free("batched")


def test_a_client_leaving_a_batched_stream_frees_every_block(served_apps: ServedApps) -> None:
    before = served_apps.kv_stats("batched")["decode"]["num_aborted"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{served_apps.url('batched')}/v1/completions", json=body) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break
    served_apps.wait_all_free("batched")
    assert served_apps.kv_stats("batched")["decode"]["num_aborted"] == before + 1
