"""Logprobs over real HTTP on a real local Ray: chat and completion logprobs equal one
in-process engine's, streamed or not, on the disaggregated and the colocated path."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from tests.support.chat_cluster import MAX_TOKENS, client, conversations

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOP_LOGPROBS = 3


@pytest.fixture(scope="module")
def reference_logprobs(tiny_checkpoints: dict[str, str]) -> dict[str, list[TokenLogprobs]]:
    """Greedy logprobs (with 3 alternatives) of a short and a long conversation, in-process."""
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=512))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    out: dict[str, list[TokenLogprobs]] = {}
    for n, conv in enumerate(conversations()[:2]):
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conv))
        engine.add_request(f"ref-{n}", ids, params)
        out[json.dumps(conv)] = []
        while engine.has_unfinished_requests():
            for step in engine.step():
                out[json.dumps(conv)] += step.logprobs
    return out


@pytest.mark.parametrize("app", ["disagg", "colo"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_the_engine_on_every_path(
        served_apps: ServedApps, reference_logprobs, tiny_checkpoints, app: str,
        stream: bool) -> None:
    """The short conversation is prefilled on decode, the long one on the prefill worker
    (its first token's logprobs come from there); both carry the engine's values."""
    tokenizer = Tokenizer.from_checkpoint(tiny_checkpoints["llama"])
    c = client(served_apps, app)
    for conv in conversations()[:2]:
        kwargs = dict(model="tiny", messages=conv, max_tokens=MAX_TOKENS, temperature=0,
                      logprobs=True, top_logprobs=TOP_LOGPROBS, extra_body={"ignore_eos": True})
        if stream:
            chunks = [ch for ch in c.chat.completions.create(**kwargs, stream=True) if ch.choices]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            content = [e for ch in chunks if ch.choices[0].logprobs
                       for e in ch.choices[0].logprobs.content or []]
        else:
            choice = c.chat.completions.create(**kwargs).choices[0]
            text, content = choice.message.content or "", choice.logprobs.content or []
        want = reference_logprobs[json.dumps(conv)]
        assert len(content) == len(want) == MAX_TOKENS
        for got, ref in zip(content, want, strict=True):
            assert bytes(got.bytes) == tokenizer.token_bytes(ref.token_id)
            assert abs(got.logprob - ref.logprob) < 1e-3
            assert [bytes(t.bytes) for t in got.top_logprobs] == [
                tokenizer.token_bytes(tid) for tid, _ in ref.top]
            assert got.top_logprobs[0].logprob == got.logprob  # greedy: the likeliest
        shown = [bytes(e.bytes) for e, ref in zip(content, want, strict=True)
                 if tokenizer.decode([ref.token_id])]  # special tokens are not in the text
        assert b"".join(shown).decode(errors="replace") == text  # may end mid-character
    served_apps.wait_all_free(app)


def test_completion_logprobs_line_up_with_the_text(served_apps: ServedApps,
                                                   reference_logprobs) -> None:
    conv = conversations()[1]
    want = reference_logprobs[json.dumps(conv)]
    engine_prompt = [e.token_id for e in want]  # any prompt: checks the legacy lists' shape
    body = {"model": "tiny", "prompt": engine_prompt * 2, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": 2}
    r = httpx.post(f"{served_apps.url('disagg')}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:n])) for n in range(6)]
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and 1 <= len(top) <= 2 and max(top.values()) == value
