"""pdserve's Triton paged-attention kernel, run on CPU tensors by Triton's interpreter, against the
torch backend (decode rows, whole prompts, chunks after a cached prefix, in one ragged batch) and,
through the model, against transformers; and the rule that picks a backend per device.

The interpreter is set before the kernel module is imported: Triton decides it per decorated
function. It emulates float32 and float16 faithfully; bfloat16 only runs on a GPU
(benchmarks/gpu_check.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from pdserve.engine.attention import (  # noqa: E402
    AttentionMetadata,
    TorchAttentionBackend,
    choose_backend,
)

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("TRITON_INTERPRET is set to something other than 1", allow_module_level=True)

from pdserve.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

# (query_len, seq_len): decode rows, a whole prompt, chunks after a cached prefix (one ending
# mid-block, one longer than a kernel tile), a one-token context.
BATCH = [(1, 37), (23, 23), (9, 40), (1, 1), (40, 75), (1, 16)]


def _batch(block_size: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int,
           head_dim: int = 16) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for _, seq_len in BATCH]
    num_blocks = sum(needed) + 5
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    metadata = AttentionMetadata.build([q for q, _ in BATCH], [s for _, s in BATCH], tables,
                                       block_size, "cpu")
    # Large values in unused slots: a read outside a context would swamp the result.
    cache = (torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)
             * 3).to(dtype)
    query = torch.randn(metadata.num_tokens, heads, head_dim, generator=generator).to(dtype)
    return query, cache, metadata


@pytest.mark.parametrize("block_size", [16, 1, 5, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 1)])
def test_kernel_matches_torch_backend_on_a_ragged_batch(
    block_size: int, heads: int, kv_heads: int
) -> None:
    query, cache, metadata = _batch(block_size, heads, kv_heads, torch.float32, seed=block_size)
    reference = TorchAttentionBackend()
    expected = reference.attend(query, cache, metadata,
                                reference.prepare(metadata, block_size, kv_heads, query.dtype),
                                0.3)
    actual = TritonAttentionBackend().attend(query, cache, metadata, None, 0.3)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < 1e-5


def test_kernel_in_float16_with_a_head_dim_that_is_not_a_power_of_two() -> None:
    query, cache, metadata = _batch(16, 4, 2, torch.float16, seed=3, head_dim=24)
    reference = TorchAttentionBackend()
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


def test_backend_rule_per_device_dtype_block_size_and_capability() -> None:
    bf16 = torch.bfloat16
    assert choose_backend("cpu", bf16, 16, None, None, None).name == "torch"
    ampere = (8, 0)
    assert choose_backend("cuda", bf16, 256, ampere, None, None).name == "flash-attn"
    # Block 16: flash-attn's paged kernel refuses it, so Triton serves it without a copy.
    small = choose_backend("cuda", bf16, 16, ampere, None, None)
    assert small.name == "triton" and "multiples of 256" in small.reason
    turing = choose_backend("cuda", bf16, 256, (7, 5), None, None)
    assert turing.name == "triton" and "compute capability >= 8.0" in turing.reason
    assert "7.5" in turing.reason
    assert choose_backend("cuda", torch.float32, 256, ampere, None, None).name == "triton"
    missing = choose_backend("cuda", bf16, 256, ampere, "it did not import", None)
    assert missing.name == "triton" and "did not import" in missing.reason
    unknown = choose_backend("cuda", bf16, None, ampere, None, None)  # a model loaded alone
    assert unknown.name == "triton" and "no KV block size" in unknown.reason
    neither = choose_backend("cuda", bf16, 16, ampere, None, "it did not import")
    assert neither.name == "torch" and "Triton is unusable" in neither.reason
