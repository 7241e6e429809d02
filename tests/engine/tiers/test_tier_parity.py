"""The host tier on a real tiny model: a prefix evicted from device KV loads back from the
host tier and the greedy tokens equal a one-tier engine's, on a hit, a miss, a partial hit,
a failed load (corrupt host bytes: computed instead), and under eviction pressure; every
block of both tiers is back to baseline after."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.cache import GIB, kv_cache_bytes
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.sampling_params import SamplingParams
from tests.support.kv_tiers import run, settle

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DEVICE_BLOCKS = 24  # 384 tokens at block size 16: two documents evict a third


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints: dict[str, str]) -> LoadedModel:
    return LoadedModel.load(tiny_checkpoints["llama"], torch.float32, torch.device("cpu"))


def make(loaded: LoadedModel, path: str, host_blocks: int, device_blocks: int) -> LLMEngine:
    layout_bytes = 0
    probe = LLMEngine(engine_config(path, num_kv_blocks=1), loaded=loaded)
    layout_bytes = kv_cache_bytes(probe.layout, 1)
    probe.close()
    return LLMEngine(engine_config(path, num_kv_blocks=device_blocks, kv_load_policy="always",
                                   host_kv_cache_gb=host_blocks * layout_bytes / GIB),
                     loaded=loaded)


def documents(vocab: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    return {name: [rng.randrange(3, vocab) for _ in range(120)] for name in "ABCDE"}


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, tiny_checkpoints: dict[str, str]) -> LLMEngine:
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=512,
                                   enable_prefix_caching=False), loaded=loaded)


def expected(reference: LLMEngine, prompt: list[int]) -> list[int]:
    return reference.generate([prompt], GREEDY)[0]


def test_hit_miss_partial_hit_and_failed_load_match_one_tier(
        loaded: LoadedModel, tiny_checkpoints: dict[str, str], reference: LLMEngine) -> None:
    engine = make(loaded, tiny_checkpoints["llama"], host_blocks=64, device_blocks=DEVICE_BLOCKS)
    docs = documents(loaded.config.vocab_size)
    question = [5, 6, 7, 8, 9]
    first = run(engine, {"a1": docs["A"] + question})["a1"]
    assert first[0] == expected(reference, docs["A"] + question)
    assert first[1].num_device_tokens == 0 and first[1].decision is None  # a miss
    for name in "BCD":  # push A out of the device cache
        run(engine, {name: docs[name] + question})
        settle(engine)
    loads: list[bool] = []
    engine.tiers.on_load = lambda: loads.append(True)  # where the loading_kv fault point sits
    hit = run(engine, {"a2": docs["A"] + question})["a2"]
    assert hit[0] == expected(reference, docs["A"] + question)
    assert hit[1].tier == "host" and hit[1].num_loaded_tokens >= 96, hit[1]
    assert loads == [True]  # told once, as the one copy was submitted
    partial_prompt = docs["A"][:64] + [11, 12, 13] * 20
    for name in "BCE":
        run(engine, {name + "2": docs[name] + [1, 2]})
        settle(engine)
    partial = run(engine, {"p": partial_prompt})["p"]
    assert partial[0] == expected(reference, partial_prompt)
    assert partial[1].num_device_tokens + partial[1].num_loaded_tokens == 64, partial[1]
    settle(engine)
    engine.close()


def test_a_corrupt_host_block_is_never_used_the_prefix_is_computed(
        loaded: LoadedModel, tiny_checkpoints: dict[str, str], reference: LLMEngine) -> None:
    engine = make(loaded, tiny_checkpoints["llama"], host_blocks=64, device_blocks=DEVICE_BLOCKS)
    docs = documents(loaded.config.vocab_size)
    run(engine, {"a": docs["A"] + [1]})
    for name in "BCD":
        run(engine, {name: docs[name] + [1]})
        settle(engine)
    tier = engine.tiers.host
    assert tier is not None
    tier.host.add_(1.0)  # every host block's bytes change behind its digest
    again = run(engine, {"a2": docs["A"] + [1]})["a2"]
    assert again[0] == expected(reference, docs["A"] + [1])
    assert again[1].failure == "digest" and again[1].num_loaded_tokens == 0
    assert engine.kv_stats().tiers.num_load_failures == 1
    settle(engine)
    engine.close()


def test_parity_under_eviction_pressure_with_both_tiers_busy(
        loaded: LoadedModel, tiny_checkpoints: dict[str, str], reference: LLMEngine) -> None:
    engine = make(loaded, tiny_checkpoints["llama"], host_blocks=40, device_blocks=20)
    docs = documents(loaded.config.vocab_size)
    prompts = {f"{name}{k}": docs[name][:100] + [k + 3] for k in range(3) for name in "ABCDE"}
    for round_ in range(2):
        outputs = run(engine, {f"{rid}-{round_}": p for rid, p in prompts.items()})
        for rid, prompt in prompts.items():
            assert outputs[f"{rid}-{round_}"][0] == expected(reference, prompt), rid
        engine.kv_stats()  # integrity of both tiers mid-run
    stats = engine.kv_stats().tiers
    assert stats.num_host_stores > 0 and stats.num_host_loads > 0, stats
    settle(engine)
    engine.close()
