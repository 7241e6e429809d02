"""When the KV handoff fails, decode recomputes and the client still gets the right answer.

The fault is real: the prefill worker holds a different cluster token, so the decode
worker's receiver refuses its link and the reservation fails at its deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.support.failing_handoff import failing_handoff_app

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["Tell me about the weather in spring and the birds that return. " * 2,
           "List three uses of a paperclip, then explain each in one sentence. " * 2]


@pytest.fixture(scope="module")
def fallback_app(served_apps: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    with failing_handoff_app(served_apps, tiny_checkpoints["llama"], "fallback") as url:
        yield url


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_failed_handoff_recomputes_with_parity(fallback_app: str, served_apps: ServedApps,
                                               tiny_checkpoints, temperature: float) -> None:
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))
    before = httpx.get(f"{fallback_app}/metrics", timeout=30).text
    for prompt in PROMPTS:
        conv = [{"role": "user", "content": prompt}]
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conv))
        params = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True)
        [want] = engine.generate([ids], params)
        r = httpx.post(f"{fallback_app}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": conv, "max_tokens": 10, "temperature": temperature,
            "seed": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(want)
        assert r.json()["usage"]["completion_tokens"] == 10
    after = httpx.get(f"{fallback_app}/metrics", timeout=30).text
    fallbacks = [line for line in after.splitlines()
                 if line.startswith('pdserve:fallbacks_total{reason="handoff_failed"}')]
    assert fallbacks and float(fallbacks[0].split()[-1]) >= len(PROMPTS)
    assert before != after
    served_apps.wait_all_free("fallback")
