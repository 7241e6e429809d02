"""The KV cache and staging sizes as a GPU worker computes them, from memory figures given here
(what torch.cuda would report), and what a CPU engine does without them."""

from __future__ import annotations

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.kv_sizing import (
    GIB,
    DeviceMemory,
    default_staging_bytes,
    kv_budget_from_memory,
    kv_budget_from_size,
    kv_bytes_per_token,
)

# Llama-3-8B's cache: 32 layers, 8 KV heads of 128, bf16: 128 KiB per token.
LLAMA3_8B = KVLayout("fp", "bfloat16", block_size=16, num_layers=32, num_kv_heads=8,
                     head_dim=128)
# Qwen2.5-7B (configs/gpu-example.yaml): 28 layers, 4 KV heads of 128, bf16: 56 KiB per token.
QWEN25_7B = KVLayout("fp", "bfloat16", block_size=16, num_layers=28, num_kv_heads=4,
                     head_dim=128)


def test_bytes_per_token_and_the_default_staging_of_one_step() -> None:
    assert kv_bytes_per_token(LLAMA3_8B) == 128 << 10
    assert default_staging_bytes(LLAMA3_8B, 2048) == 256 << 20
    tiny = KVLayout("fp", "float32", block_size=16, num_layers=3, num_kv_heads=2, head_dim=16)
    assert default_staging_bytes(tiny, 1024) == 1 << 20  # 768 KiB of KV: the 1 MiB floor


def test_kv_gets_the_fraction_left_after_use_peak_activations_and_staging() -> None:
    memory = DeviceMemory(total_bytes=80 * GIB, free_bytes=64 * GIB,
                          peak_activation_bytes=2 * GIB)
    budget = kv_budget_from_memory(LLAMA3_8B, memory, 0.9, staging_bytes=256 << 20)
    left = int(80 * GIB * 0.9) - 16 * GIB - 2 * GIB - (256 << 20)
    per_block = 32 * LLAMA3_8B.block_bytes
    assert budget.num_blocks == left // per_block
    assert budget.kv_bytes == budget.num_blocks * per_block <= left
    assert "16.00 GiB in use" in budget.reason and "0.25 GiB staging" in budget.reason
    # More utilization, more blocks; a larger staging comes out of the cache.
    assert kv_budget_from_memory(LLAMA3_8B, memory, 0.95, 256 << 20).num_blocks > budget.num_blocks
    assert kv_budget_from_memory(LLAMA3_8B, memory, 0.9, 1 << 30).num_blocks < budget.num_blocks


def test_no_room_is_refused_with_every_figure() -> None:
    memory = DeviceMemory(total_bytes=24 * GIB, free_bytes=2 * GIB, peak_activation_bytes=GIB)
    with pytest.raises(InvalidRequestError, match="no room for the KV cache.*22.00 GiB in use"):
        kv_budget_from_memory(LLAMA3_8B, memory, 0.9, 0)
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        kv_budget_from_memory(LLAMA3_8B, memory, 1.5, 0)


def test_the_gpu_example_fits_an_a10g_with_room_for_its_longest_request() -> None:
    """configs/gpu-example.yaml on cluster/aws-gpu.yaml's g5.2xlarge: a 24 GB A10G reports
    ~22.5 GiB; bf16 Qwen2.5-7B weights take ~14.2 GiB plus ~0.5 GiB of CUDA context."""
    memory = DeviceMemory(total_bytes=int(22.5 * GIB), free_bytes=int(22.5 * GIB) - int(14.7 * GIB),
                          peak_activation_bytes=int(1.0 * GIB))
    staging = default_staging_bytes(QWEN25_7B, 4096)
    budget = kv_budget_from_memory(QWEN25_7B, memory, 0.9, staging)
    tokens = budget.num_blocks * QWEN25_7B.block_size
    assert tokens >= 4 * 8192  # several requests at max_model_len


def test_configured_sizes_win_and_cpu_has_a_default() -> None:
    assert kv_budget_from_size(LLAMA3_8B, 100, None).num_blocks == 100
    per_block = 32 * LLAMA3_8B.block_bytes
    assert kv_budget_from_size(LLAMA3_8B, None, 1.0).num_blocks == GIB // per_block
    assert kv_budget_from_size(LLAMA3_8B, None, None).num_blocks == GIB // 2 // per_block
