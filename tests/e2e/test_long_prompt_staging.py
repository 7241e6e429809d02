"""Over real Ray Serve and HTTP: a prompt whose KV is 8x the handoff staging of each worker is
served disaggregated (its KV streams through staging; no recompute) with greedy parity against
one engine in one process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.support.metrics import metric_value

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "smallstaging"
STAGING_MB = 1 / 16  # 64 KiB per worker and side
KV_BYTES_PER_TOKEN = 768  # the tiny Llama in float32: 3 layers x K, V x 2 heads x 16 x 4 bytes


@pytest.fixture(scope="module")
def small_staging_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    from tests.support.ray_serve import app_config

    config = app_config(tiny_checkpoints["llama"], "disaggregated")
    config["handoff"]["staging_buffer_mb"] = STAGING_MB
    with ray_serve.deploy(APP, config) as url:
        yield url


def test_prompt_with_kv_8x_the_staging_is_served_disaggregated_with_parity(
        small_staging_app: str, ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> None:
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))
    num_tokens = 700
    assert num_tokens * KV_BYTES_PER_TOKEN >= 8 * STAGING_MB * (1 << 20)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(num_tokens)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [want] = engine.generate([prompt], params)
    before = httpx.get(f"{small_staging_app}/metrics", timeout=30).text
    r = httpx.post(f"{small_staging_app}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == engine.tokenizer.decode(want)
    after = httpx.get(f"{small_staging_app}/metrics", timeout=30).text
    done = ("pdserve:requests_total", 'path="disaggregated"')
    assert metric_value(after, *done) == metric_value(before, *done) + 1
    assert (metric_value(after, "pdserve:fallbacks_total")
            == metric_value(before, "pdserve:fallbacks_total"))
    ray_serve.wait_all_free(APP)
