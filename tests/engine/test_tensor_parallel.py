"""Tensor parallelism in the engine, ranks as threads over gloo: logits of TP=2 (and 4) equal
TP=1 and transformers in float32 for Llama and Qwen2 (q/k/v bias, tied embeddings), with KV
heads fewer than the ranks as well as at least as many; greedy generation through rank 0's
engine and the other ranks' `ShardEngine` equals one rank; shapes that cannot split are refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.checkpoint import load_model
from pdserve.engine.checkpoint_maker import make_checkpoint
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.cache import allocate_kv_cache, kv_layout_for
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TPGroup
from pdserve.engine.parallel.shard import TPSplitError, check_tp_fits
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.shard_engine import run_shard
from tests.engine.paged_runs import shuffled_block_tables
from tests.support.tp_ranks import run_ranks

TOLERANCE = 1e-4
LENGTHS = [1, 9, 40]
BLOCK_SIZE = 4

# Held-out shapes (make-model's size flags over the tiny preset): (family, overrides, tied).
# tiny itself has 4 heads and 2 KV heads; vocab 1001 does not split evenly, so the last rank's
# vocabulary rows are padding.
SHAPES = {
    "llama_kv2": ("llama", {}, False),  # KV heads = ranks (TP 2)
    "llama_kv1": ("llama", {"num_kv_heads": 1, "vocab_size": 1001}, False),  # KV heads < ranks
    "qwen2_kv1_tied": ("qwen2", {"num_kv_heads": 1}, True),  # biases, tied, KV heads < ranks
    "qwen2_kv4": ("qwen2", {"num_kv_heads": 4, "intermediate_size": 128}, False),  # KV > ranks
}
CASES = [(name, 2) for name in SHAPES] + [("llama_kv2", 4)]  # TP 4: each KV head on 2 ranks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_checkpoints")
    return {name: str(make_checkpoint(root / name, family, "tiny", seed=3, shape=shape,
                                      tie_word_embeddings=tied))
            for name, (family, shape, tied) in SHAPES.items()}


def _prompts(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]


def _paged_logits(path: str, tp: TPGroup, prompts: list[torch.Tensor]) -> torch.Tensor | None:
    """Every prompt in one step over shuffled blocks of this rank's cache; rank 0's logits."""
    model, config = load_model(path, torch.float32, tp=tp)
    tables, num_blocks = shuffled_block_tables(LENGTHS, BLOCK_SIZE, seed=2)
    layout = kv_layout_for(config, "test", torch.float32, BLOCK_SIZE, tp.rank, tp.size)
    cache = allocate_kv_cache(layout, num_blocks, "cpu").normal_(0, 100)  # unread noise
    metadata = AttentionMetadata.build(LENGTHS, LENGTHS, tables, BLOCK_SIZE, "cpu")
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return model.compute_logits(model(torch.cat(prompts), positions, cache, metadata))


@pytest.mark.parametrize("name, size", CASES)
def test_logits_equal_one_rank_and_transformers(checkpoints, name: str, size: int) -> None:
    from transformers import AutoModelForCausalLM

    path = checkpoints[name]
    config = ModelConfig.from_checkpoint(path)
    prompts = _prompts(config.vocab_size)
    split = run_ranks(size, lambda tp: _paged_logits(path, tp, prompts))
    assert all(logits is None for logits in split[1:]), "only rank 0 gets the logits"
    (one,) = run_ranks(1, lambda tp: _paged_logits(path, tp, prompts))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.cat([reference(p[None]).logits[0] for p in prompts])
    assert split[0] is not None and split[0].shape == (sum(LENGTHS), config.vocab_size)
    assert (split[0] - one).abs().max().item() <= TOLERANCE
    assert (split[0] - expected).abs().max().item() <= TOLERANCE


def _generate(path: str, tp: TPGroup, prompts: list[list[int]]) -> list[list[int]] | int:
    config = engine_config(path, num_kv_blocks=128, block_size=BLOCK_SIZE,
                           max_num_batched_tokens=24)  # chunked prompts, mixed steps
    if not tp.is_first:
        return run_shard(config, tp)
    engine = LLMEngine(config, tp=tp)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return engine.generate(prompts, params)
    finally:
        engine.stop_ranks()


@pytest.mark.parametrize("name", ["llama_kv1", "qwen2_kv4"])
def test_greedy_generation_equals_one_rank(checkpoints, name: str) -> None:
    path = checkpoints[name]
    prompts = [p.tolist() for p in _prompts(ModelConfig.from_checkpoint(path).vocab_size)]
    tokens, num_steps = run_ranks(2, lambda tp: _generate(path, tp, prompts))
    (alone,) = run_ranks(1, lambda tp: _generate(path, tp, prompts))
    assert tokens == alone
    assert isinstance(num_steps, int) and num_steps > 12  # rank 1 ran every step with rank 0


def test_shapes_that_do_not_split_are_refused(checkpoints) -> None:
    config = ModelConfig.from_checkpoint(checkpoints["llama_kv2"])  # 4 heads, 2 KV, inter 192
    check_tp_fits(config, 4)
    with pytest.raises(TPSplitError, match="num_attention_heads 4 is not a multiple of it"):
        check_tp_fits(config, 3)
    wide = dataclasses.replace(config, num_heads=12, num_kv_heads=4, intermediate_size=190)
    with pytest.raises(TPSplitError, match="num_key_value_heads 4 neither is a multiple of it "
                                           "nor divides it; intermediate_size 190"):
        check_tp_fits(wide, 6)


def test_an_nccl_group_ends_its_process_on_a_stuck_collective_whatever_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The modes that hang, or go on with an aborted collective's partial sums, are never
    in force when an NCCL group is made (here it fails after the settings: no NCCL or GPU)."""
    import datetime
    import os

    import torch.distributed as dist

    from pdserve.engine.parallel.group import NCCL_ERROR_HANDLING, _nccl

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.raises((RuntimeError, ValueError)):
        _nccl(dist.HashStore(), 0, 1, datetime.timedelta(seconds=1), torch.device("cpu"))
    assert {key: os.environ[key] for key in NCCL_ERROR_HANDLING} == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "0"}


def test_step_plans_of_any_size_reach_every_rank_whole() -> None:
    """One frame holds most plans; a longer one sends the rest after it; None stops."""
    import os

    from pdserve.engine.parallel.group import PLAN_FRAME_BYTES

    room = PLAN_FRAME_BYTES - 8
    payloads = [b"", os.urandom(100), os.urandom(room), os.urandom(room + 1),
                os.urandom(5 * PLAN_FRAME_BYTES + 3), None]

    def exchange(group: TPGroup) -> list[bytes | None]:
        sent = payloads if group.is_first else [None] * len(payloads)
        return [group.broadcast_plan(p) for p in sent]

    for received in run_ranks(3, exchange):
        assert received == payloads
