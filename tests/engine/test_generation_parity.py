"""Greedy generation through the paged engine equals transformers' greedy generate.

Covers one-by-one, staggered continuous batching, chunked prefill, prefix reuse and preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.sampling_params import SamplingParams

PROMPT_LENGTHS = [1, 5, 17, 64, 150, 333, 700, 1030]
MAX_NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints: dict[str, str], family: str) -> LoadedModel:
    return LoadedModel.load(tiny_checkpoints[family], torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    rng = random.Random(1234)
    special = set(loaded.tokenizer.eos_token_ids)
    vocab = [t for t in range(loaded.config.vocab_size) if t not in special]
    return [[rng.choice(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints: dict[str, str], family: str,
              prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding effects)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family], dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                min_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0,
            )
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def make_engine(loaded: LoadedModel, path: str, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {
        "block_size": 16, "num_kv_blocks": 512, "max_num_batched_tokens": 2048}
    settings.update(overrides)
    return LLMEngine(engine_config(path, **settings), loaded=loaded)  # type: ignore[arg-type]


def assert_all_free(engine: LLMEngine) -> None:
    engine.kv_manager.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_reference_is_not_degenerate(reference: list[list[int]]) -> None:
    # A model that repeats one token would make every comparison below trivially pass.
    assert any(len(set(out)) > 3 for out in reference)


def test_one_by_one(loaded, tiny_checkpoints, family, prompts, reference) -> None:
    engine = make_engine(loaded, tiny_checkpoints[family])
    for prompt, expected in zip(prompts, reference, strict=True):
        assert engine.generate([prompt], GREEDY) == [expected]
    assert_all_free(engine)


def test_staggered_continuous_batch(loaded, tiny_checkpoints, family, prompts, reference) -> None:
    engine = make_engine(loaded, tiny_checkpoints[family], block_size=8)
    assert staggered(engine, prompts) == reference
    assert_all_free(engine)


# A minute: no step outlasts it (the whole cap); 1 us: every step does (one block a step).
@pytest.mark.parametrize("bound_ms", [60_000.0, 0.001])
def test_decode_prompt_cap(loaded, tiny_checkpoints, family, prompts, reference,
                           bound_ms: float) -> None:
    engine = make_engine(loaded, tiny_checkpoints[family], block_size=8,
                         decode_prompt_tokens_per_step=32, decode_step_bound_ms=bound_ms)
    assert staggered(engine, prompts) == reference
    assert engine.scheduler._planner.allowance.tokens == (32 if bound_ms > 1 else 8)
    assert_all_free(engine)


def staggered(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, arriving in shuffled order every third step."""
    tokens: dict[str, list[int]] = {}
    order = list(range(len(prompts)))
    random.Random(7).shuffle(order)
    step = 0
    while order or engine.has_unfinished_requests():
        if order and step % 3 == 0:  # a new arrival every third step, mid-decode of others
            i = order.pop()
            engine.add_request(f"r{i}", prompts[i], GREEDY)
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        step += 1
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("chunk", [13, 40])
def test_chunked_prefill(loaded, tiny_checkpoints, family, prompts, reference, chunk: int) -> None:
    engine = make_engine(loaded, tiny_checkpoints[family], block_size=16,
                         max_num_batched_tokens=chunk * 2, long_prefill_token_threshold=chunk)
    assert engine.generate(prompts, GREEDY) == reference
    # Chunks of 13 or 40 tokens cannot be aligned to 16-token blocks: blocks were split.
    assert engine.stats.num_steps > max(PROMPT_LENGTHS) // (chunk * 2)
    assert_all_free(engine)


def test_shared_prefix_computes_only_suffix(
        loaded, tiny_checkpoints, family, prompts, reference) -> None:
    engine = make_engine(loaded, tiny_checkpoints[family], block_size=16)
    long_prompt = prompts[-1]
    assert engine.generate([long_prompt], GREEDY) == [reference[-1]]
    computed_before = engine.stats.num_tokens_computed
    suffix = prompts[2]
    shared = long_prompt[:700] + suffix
    engine.add_request("second", shared, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    cached = outs[0].num_cached_tokens
    assert cached == 700 // 16 * 16
    computed = engine.stats.num_tokens_computed - computed_before
    # Only the uncached prompt tail plus one pass per generated token (the last is not fed back).
    assert computed == len(shared) - cached + MAX_NEW_TOKENS - 1
    assert_all_free(engine)


def test_preemption_under_kv_pressure(loaded, tiny_checkpoints, family, prompts, reference) -> None:
    # 1030 + 20 tokens need 66 blocks of 16; all eight need ~155. Chunked prefill admits the long
    # prompts with a few blocks each, so they outgrow the cache while others run: preemption.
    engine = make_engine(loaded, tiny_checkpoints[family], block_size=16, num_kv_blocks=70,
                         max_num_batched_tokens=256, long_prefill_token_threshold=64)
    assert engine.generate(prompts, GREEDY) == reference
    assert engine.stats.num_preemptions > 0
    assert_all_free(engine)
