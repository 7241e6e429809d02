"""Serving apps with KV tiers in tests: a host tier sized in blocks, random documents and the
one-engine greedy text of each, a completion with the server's timings, and whether every
tier of every role is back to baseline."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.cache import GIB, kv_bytes_per_token
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps


def host_gb(path: str, num_blocks: int) -> float:
    """engine.host_kv_cache_gb for ``num_blocks`` float32 blocks of 16 tokens."""
    return num_blocks * 16 * kv_bytes_per_token(ModelConfig.from_checkpoint(path), "float32") / GIB


def complete(url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy completion of token ids with `pdserve_timings`; asserts a 200."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "pdserve_timings": True})
    assert r.status_code == 200, r.text
    return r.json()


def settled(served: ServedApps, app: str) -> bool:
    """Every role's device blocks free or cached, nothing loading, no host block read or
    written, no block pinned for a store put."""
    return all(s["num_free_blocks"] == s["num_blocks"] and s["num_loading"] == 0
               and s["tiers"]["num_host_busy_blocks"] == 0
               and s["tiers"]["num_store_pinned_blocks"] == 0
               for s in served.kv_stats(app).values())


def random_documents(checkpoint: str, count: int, num_tokens: int,
                     seed: int) -> list[list[int]]:
    """``count`` documents of ``num_tokens`` random ids (no special ones), reproducible."""
    vocab = ModelConfig.from_checkpoint(checkpoint).vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(num_tokens)] for _ in range(count)]


@contextmanager
def greedy_completer(checkpoint: str, max_tokens: int) -> Iterator[Callable[[list[int]], str]]:
    """One engine without a prefix cache: the greedy text of ``max_tokens`` for a prompt."""
    engine = LLMEngine(engine_config(checkpoint, num_kv_blocks=512,
                                     enable_prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        yield lambda ids: engine.tokenizer.decode(engine.generate([ids], params)[0])
    finally:
        engine.close()


def tiny_fixtures(num_documents: int, doc_tokens: int, seed: int,
                  max_tokens: int) -> tuple[Any, Any]:
    """Module fixtures over the tiny llama: `random_documents` and a `greedy_completer`."""
    import pytest

    @pytest.fixture(scope="module")
    def documents(tiny_checkpoints: dict[str, str]) -> list[list[int]]:
        return random_documents(tiny_checkpoints["llama"], num_documents, doc_tokens, seed)

    @pytest.fixture(scope="module")
    def greedy(tiny_checkpoints: dict[str, str]) -> Iterator[Callable[[list[int]], str]]:
        with greedy_completer(tiny_checkpoints["llama"], max_tokens) as complete_greedily:
            yield complete_greedily
    return documents, greedy


def timings_with_cached(body: dict[str, Any]) -> dict[str, Any]:
    """A completion's first pdserve timings, with the prompt tokens it found cached."""
    return body["pdserve_timings"][0] | {
        "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def ask_each_twice(url: str, documents: list[list[int]], greedy: Callable[[list[int]], str],
                   max_tokens: int, between: Callable[[], None] | None = None,
                   ) -> list[dict[str, Any]]:
    """Each document twice (a different question the second time), every answer checked
    against one engine; ``between`` runs after the first round. The second round's timings
    (with cached tokens)."""
    second = []
    for round_ in range(2):
        for k, doc in enumerate(documents):
            ids = doc + [5 + round_, 6, 7]
            body = complete(url, ids, max_tokens)
            assert body["choices"][0]["text"] == greedy(ids), (round_, k)
            if round_:
                second.append(timings_with_cached(body))
        if not round_ and between is not None:
            between()
    return second
