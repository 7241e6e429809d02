"""pdserve's Triton paged-attention kernel, run on CPU tensors by Triton's interpreter, against the
torch backend (decode rows, whole prompts, chunks after a cached prefix, in one ragged batch) and,
through the model, against transformers.

Collected only in a process of its own with TRITON_INTERPRET=1 set before Triton is imported
(`tests/engine/test_triton_attention.py` starts it): Triton decides per decorated function
whether it is interpreted, so setting it inside a shared test process would turn the kernel
that GPU tests compile into the interpreter. The interpreter emulates float32 and float16
faithfully; bfloat16 runs only on a GPU (the compiled kernel's cases are GPU tests).
"""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.attention import TorchAttentionBackend

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 in a process of its own "
                "(tests/engine/test_triton_attention.py)", allow_module_level=True)
triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

from pdserve.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.engine.attention_batches import ragged_batch as _batch  # noqa: E402


@pytest.mark.parametrize("block_size", [16, 1, 5, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_kernel_matches_torch_backend_on_a_ragged_batch(
    block_size: int, heads: int, kv_heads: int
) -> None:
    query, cache, metadata = _batch(block_size, heads, kv_heads, torch.float32, seed=block_size)
    reference = TorchAttentionBackend(c_kernel=False)
    expected = reference.attend(query, cache, metadata,
                                reference.prepare(metadata, block_size, kv_heads, query.dtype),
                                0.3)
    actual = TritonAttentionBackend().attend(query, cache, metadata, None, 0.3)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < 1e-5


def test_kernel_in_float16_with_a_head_dim_that_is_not_a_power_of_two() -> None:
    query, cache, metadata = _batch(16, 4, 2, torch.float16, seed=3, head_dim=24)
    reference = TorchAttentionBackend(c_kernel=False)
    expected = reference.attend(query.float(), cache.float(), metadata,
                                reference.prepare(metadata, 16, 2, torch.float32), 0.2)
    actual = TritonAttentionBackend().attend(query, cache, metadata, None, 0.2)
    assert actual.dtype == torch.float16
    assert (actual.float() - expected).abs().max().item() < 2e-2


def test_kernel_reads_a_strided_query_view() -> None:
    """The model hands attention a slice of its fused q/k/v projection."""
    query, cache, metadata = _batch(16, 4, 2, torch.float32, seed=4)
    fused = torch.cat([query, torch.full_like(query, 1e4)], dim=1)  # junk beside each row
    strided = fused[:, :4]
    assert not strided.is_contiguous()
    actual = TritonAttentionBackend().attend(strided, cache, metadata, None, 0.25)
    expected = TritonAttentionBackend().attend(query.contiguous(), cache, metadata, None, 0.25)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("block_size", [16, 3])
def test_model_with_triton_attention_matches_transformers(
    tiny_checkpoints: dict[str, str], block_size: int
) -> None:
    """Chunked prompts then decode steps through shuffled blocks, all sequences together."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.checkpoint import load_model
    from tests.engine.paged_runs import garbage_cache, run_schedule, shuffled_block_tables

    path = tiny_checkpoints["qwen2"]  # GQA: 4 heads over 2 KV heads
    model, config = load_model(path, torch.float32)
    model.attention_backend = TritonAttentionBackend()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(11)
    lengths = [1, 7, 33, 70]
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in lengths]
    tables, num_blocks = shuffled_block_tables(lengths, block_size, seed=block_size)
    logits, saw_mixed = run_schedule(model, garbage_cache(model, num_blocks, block_size),
                                     prompts, tables, block_size)
    assert saw_mixed  # decode rows and prompt chunks shared a step
    with torch.inference_mode():
        for prompt, ours in zip(prompts, logits, strict=True):
            theirs = reference(prompt[None]).logits[0].float()
            assert (ours - theirs).abs().max().item() < 1e-4


# Decode rows over long contexts, a one-token context and one shorter than a split.
DECODE_BATCH = [(1, 300), (1, 77), (1, 1), (1, 129), (2, 260)]


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_splits", [2, 3, 10])
def test_contexts_split_among_programs_combine_to_the_unsplit_answer(
        block_size: int, num_splits: int) -> None:
    from pdserve.engine.attention.triton_kernel import BLOCK_M, LaunchShape, paged_attention
    from tests.engine.attention_batches import torch_reference

    query, cache, metadata = _batch(block_size, 8, 2, torch.float32, seed=num_splits,
                                    batch=DECODE_BATCH)
    chunk = -(-metadata.max_seq_len // num_splits)
    chunk = -(-chunk // 32) * 32
    shape = LaunchShape(BLOCK_M, -(-metadata.max_seq_len // chunk), chunk)
    assert shape.num_splits > 1
    actual = paged_attention(query, cache, metadata.block_tables, metadata.query_start_loc,
                             metadata.seq_lens_tensor, metadata.max_query_len,
                             metadata.max_seq_len, 0.3, shape)
    expected = torch_reference(query, cache, metadata, 0.3)
    assert (actual - expected).abs().max().item() < 1e-5


def test_small_and_large_query_tiles_agree_on_prompt_chunks() -> None:
    from pdserve.engine.attention.triton_kernel import (
        BLOCK_M,
        PREFILL_BLOCK_M,
        LaunchShape,
        paged_attention,
    )
    from tests.engine.attention_batches import torch_reference

    query, cache, metadata = _batch(16, 4, 2, torch.float32, seed=21)
    expected = torch_reference(query, cache, metadata, 0.3)
    for block_m in (BLOCK_M, PREFILL_BLOCK_M):
        actual = paged_attention(query, cache, metadata.block_tables, metadata.query_start_loc,
                                 metadata.seq_lens_tensor, metadata.max_query_len,
                                 metadata.max_seq_len, 0.3,
                                 LaunchShape(block_m, 1, metadata.max_seq_len))
        assert (actual - expected).abs().max().item() < 1e-5, block_m
