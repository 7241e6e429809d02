"""The engine's two disaggregated roles and its text stream, on a real tiny model.

Prefill-only + copied KV + decode-from-received-KV must equal one engine doing everything.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.errors import InconsistentKVError, InvalidRequestError
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints: dict[str, str]) -> LoadedModel:
    return LoadedModel.load(tiny_checkpoints["qwen2"], torch.float32, torch.device("cpu"))


def engine(loaded: LoadedModel, path: str, **kw: object) -> LLMEngine:
    settings: dict[str, object] = {"num_kv_blocks": 256, "block_size": 8}
    settings.update(kw)
    return LLMEngine(engine_config(path, **settings), loaded=loaded)  # type: ignore[arg-type]


def run_until_finished(e: LLMEngine, request_id: str) -> tuple[list[int], str, str | None]:
    tokens, text, reason = [], "", None
    while e.has_unfinished_requests():
        for out in e.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                text += out.new_text
                reason = out.finish_reason if out.finished else reason
    return tokens, text, reason


def split_generate(prefill: LLMEngine, decode: LLMEngine, prompt: list[int],
                   params: SamplingParams, rid: str) -> list[int]:
    """Prefill on one engine, copy the prompt's KV block by block, decode on the other."""
    prefill.add_request(rid, prompt, params, RequestMode.PREFILL_ONLY)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.request_id == rid), None)
    assert first.finish_reason == "prefilled" and len(first.new_token_ids) == 1
    slots = decode.reserve_for_received_kv(rid, prompt, params)
    assert slots is not None
    first_block = slots.num_cached_tokens // decode.layout.block_size  # decode holds these
    src = prefill.kv_manager.block_ids(rid)[first_block:first_block + len(slots.block_ids)]
    decode.kv_cache[:, :, slots.block_ids] = prefill.kv_cache[:, :, src]
    prefill.release(rid)
    decode.activate_received(rid, first.new_token_ids[0])
    rest, _, _ = run_until_finished(decode, rid)
    return first.new_token_ids + rest


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_prefill_then_decode_equals_one_engine(loaded, tiny_checkpoints, params) -> None:
    path = tiny_checkpoints["qwen2"]
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (1, 9, 40, 257)]
    whole = engine(loaded, path)
    prefill, decode = engine(loaded, path), engine(loaded, path, block_size=8)
    for i, prompt in enumerate(prompts):
        expected = whole.generate([prompt], params)[0]
        assert split_generate(prefill, decode, prompt, params, f"r{i}") == expected
    for e in (prefill, decode):
        stats = e.kv_stats()
        assert stats.num_free_blocks == stats.num_blocks


def test_decode_reuses_a_prefix_it_holds_and_receives_only_the_rest(loaded,
                                                                     tiny_checkpoints) -> None:
    """A second turn: the decode worker still caches the first turn's prompt, so it reserves
    (and the prefill side copies) only the blocks after that prefix; output is unchanged."""
    path = tiny_checkpoints["qwen2"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first_turn = list(range(200, 260))
    second_turn = first_turn + list(range(500, 530))
    whole, prefill, decode = (engine(loaded, path) for _ in range(3))
    assert split_generate(prefill, decode, first_turn, params, "t1") == whole.generate(
        [first_turn], params)[0]
    slots = decode.reserve_for_received_kv("probe", second_turn, params)
    assert slots is not None and slots.num_cached_tokens == 56  # 7 whole blocks of 8
    assert len(slots.block_ids) == decode.kv_manager.num_blocks_for(len(second_turn)) - 7
    decode.abort("probe")
    assert split_generate(prefill, decode, second_turn, params, "t2") == whole.generate(
        [second_turn], params)[0]
    for e in (prefill, decode):
        assert e.kv_stats().num_free_blocks == e.kv_stats().num_blocks


def test_recompute_resume_equals_one_engine(loaded, tiny_checkpoints) -> None:
    """The fallback path: a fresh engine given prompt + the token already shown continues
    exactly where one engine would (greedy and seeded)."""
    path = tiny_checkpoints["qwen2"]
    prompt = list(range(100, 160))
    for params in (SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)):
        expected = engine(loaded, path).generate([prompt], params)[0]
        e = engine(loaded, path)
        e.add_request("resume", prompt, params, resume_output_ids=expected[:1])
        rest, _, _ = run_until_finished(e, "resume")
        assert expected[:1] + rest == expected


def test_seeds_reproduce_and_differ(loaded, tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen2"]
    prompt = list(range(200, 230))
    e = engine(loaded, path)
    a = e.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=1))
    b = e.generate([prompt, list(range(5, 50))],
                   SamplingParams(max_tokens=20, temperature=1.0, seed=1))[0]
    c = e.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=2))
    assert a[0] == b  # same seed, different batch company: same tokens
    assert a != c


def test_every_bit_of_a_seed_counts(loaded, tiny_checkpoints) -> None:
    """Seeds that differ only above bit 31 (torch's CPU generator keeps 32 bits of what it is
    seeded with) or only in bit 63 draw different tokens."""
    e = engine(loaded, tiny_checkpoints["qwen2"])
    prompt = list(range(200, 230))
    seeds = (7, 7 + 2**32, 7 + 2**63)
    drawn = [tuple(e.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0,
                                                       seed=seed, ignore_eos=True))[0])
             for seed in seeds]
    assert len(set(drawn)) == len(seeds), drawn
    again = e.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=7 + 2**63,
                                                ignore_eos=True))[0]
    assert tuple(again) == drawn[2]


def test_token_ids_outside_the_vocabulary_are_refused(loaded, tiny_checkpoints) -> None:
    e = engine(loaded, tiny_checkpoints["qwen2"])
    vocab = loaded.config.vocab_size
    for params, name in ((SamplingParams(stop_token_ids=(3, vocab)), "stop_token_ids"),
                         (SamplingParams(logit_bias=((vocab + 5, 1.0),)), "logit_bias")):
        with pytest.raises(InvalidRequestError, match=f"{name} token id .* outside the "
                           f"vocabulary \\[0, {vocab}\\)"):
            e.add_request("r", [1, 2, 3], params)
    assert not e.has_unfinished_requests()


def test_stop_string_truncates_and_is_never_streamed(loaded, tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen2"]
    e = engine(loaded, path)
    prompt = e.tokenizer.encode("Once upon a time")
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    e.add_request("full", prompt, greedy)
    _, full_text, _ = run_until_finished(e, "full")
    assert len(full_text) > 12
    stop = full_text[8:12]
    cut = full_text.index(stop)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    e.add_request("stopped", prompt, params)
    pieces: list[str] = []
    reason = None
    while e.has_unfinished_requests():
        for out in e.step():
            pieces.append(out.new_text)
            reason = out.finish_reason if out.finished else reason
    assert "".join(pieces) == full_text[:cut]
    assert reason == "stop"
    assert all(stop not in piece for piece in pieces)
    assert e.kv_stats().num_running == 0


def test_stop_token_and_max_tokens(loaded, tiny_checkpoints) -> None:
    path = tiny_checkpoints["qwen2"]
    e = engine(loaded, path)
    prompt = list(range(300, 340))
    full = e.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop_id = full[5]
    first = full.index(stop_id)
    stopped = e.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=(stop_id,)))[0]
    assert stopped == full[: first + 1]
    assert e.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0] == full[:3]


@pytest.mark.parametrize("case", ["max_tokens_1", "eos_first"])
def test_a_first_token_that_ends_the_request_finishes_it_on_activation(
        loaded, tiny_checkpoints, case: str) -> None:
    path = tiny_checkpoints["qwen2"]
    prefill, decode = engine(loaded, path), engine(loaded, path)
    prompt = list(range(10, 60))
    eos = decode.tokenizer.eos_token_ids[0]
    params = (SamplingParams(max_tokens=1, temperature=0.0) if case == "max_tokens_1" else
              SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((eos, 100.0),)))
    prefill.add_request("r", prompt, params, RequestMode.PREFILL_ONLY)
    first = None
    while first is None:
        first = next((o for o in prefill.step() if o.request_id == "r"), None)
    slots = decode.reserve_for_received_kv("r", prompt, params)
    assert slots is not None
    out = decode.activate_received("r", first.new_token_ids[0])
    assert out.finished and out.num_output_tokens == 1
    assert out.finish_reason == ("length" if case == "max_tokens_1" else "stop")
    assert not decode.has_unfinished_requests()
    stats = decode.kv_stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_received_kv_that_is_not_one_computations_is_refused_before_any_sampling(
        loaded, tiny_checkpoints) -> None:
    """Output tokens before the first, or blocks that do not cover the prompt: activation
    raises and changes nothing; the abort that follows frees every block."""
    decode = engine(loaded, tiny_checkpoints["qwen2"])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(10, 30))
    for rid in ("out", "blocks"):
        assert decode.reserve_for_received_kv(rid, prompt, params) is not None
        request = decode.scheduler.get_request(rid)
        table = decode.kv_manager._tables[rid].block_ids  # a fault no public call can make
        lost = table.pop() if rid == "blocks" else None
        if rid == "out":
            request.output_token_ids.append(5)
        with pytest.raises(InconsistentKVError, match=rid):
            decode.activate_received(rid, 7)
        assert decode.scheduler.num_awaiting_kv == 1 and request.num_computed_tokens == 0
        if lost is not None:
            table.append(lost)
        decode.abort(rid)
    stats = decode.kv_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_awaiting_kv == 0
