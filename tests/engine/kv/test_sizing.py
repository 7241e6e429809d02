"""The KV cache's size as a GPU worker computes it, from memory figures given here (what
torch.cuda would report), and from a configured size; the staging default it sets aside."""

from __future__ import annotations

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.kv.cache import GIB
from pdserve.engine.kv.layout import KVLayout
from pdserve.engine.kv.sizing import DeviceMemory, kv_budget_from_memory, kv_budget_from_size

# Llama-3-8B's cache: 32 layers, 8 KV heads of 128, bf16: 128 KiB per token.
LLAMA3_8B = KVLayout("fp", "bfloat16", block_size=16, num_layers=32, num_kv_heads=8,
                     head_dim=128)
# Qwen2.5-7B (configs/gpu-example.yaml): 28 layers, 4 KV heads of 128, bf16: 56 KiB per token.
QWEN25_7B = KVLayout("fp", "bfloat16", block_size=16, num_layers=28, num_kv_heads=4,
                     head_dim=128)


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


def test_the_gpu_example_fits_an_a10g_with_room_for_its_longest_request() -> None:
    """configs/gpu-example.yaml on cluster/aws-gpu.yaml's g5.2xlarge: a 24 GB A10G reports
    ~22.5 GiB; bf16 Qwen2.5-7B weights take ~14.2 GiB plus ~0.5 GiB of CUDA context."""
    memory = DeviceMemory(total_bytes=int(22.5 * GIB), free_bytes=int(22.5 * GIB) - int(14.7 * GIB),
                          peak_activation_bytes=int(1.0 * GIB))
    staging = (56 << 10) * 4096  # the staging default: one 4,096-token step's KV
    budget = kv_budget_from_memory(QWEN25_7B, memory, 0.9, staging)
    tokens = budget.num_blocks * QWEN25_7B.block_size
    assert tokens >= 4 * 8192  # several requests at max_model_len


def test_a_configured_size_is_a_block_count_or_memory_turned_into_blocks() -> None:
    per_block = 32 * LLAMA3_8B.block_bytes
    by_count = kv_budget_from_size(LLAMA3_8B, 100, 0.5)
    assert (by_count.num_blocks, by_count.kv_bytes) == (100, 100 * per_block)
    assert "num_kv_blocks" in by_count.reason
    by_memory = kv_budget_from_size(LLAMA3_8B, None, 1.0)
    assert by_memory.num_blocks == GIB // per_block and "1 GiB" in by_memory.reason


def test_colocated_replicas_sharing_a_gpu_each_size_kv_from_their_share() -> None:
    """Two replicas with num_gpus 0.5 on one H200 (140 GiB), 16 GiB of weights each: the one
    that starts second still finds its share, and together they stay within 0.9 of the device."""
    total, weights, context, peak = 140 * GIB, 16 * GIB, GIB // 2, 2 * GIB
    first = kv_budget_from_memory(
        LLAMA3_8B, DeviceMemory(total, total - weights - context, peak, own_bytes=weights),
        0.9, staging_bytes=0, device_share=0.5)
    used_by_first = weights + context + first.kv_bytes
    second = kv_budget_from_memory(
        LLAMA3_8B,
        DeviceMemory(total, total - used_by_first - weights - context, peak, own_bytes=weights),
        0.9, staging_bytes=0, device_share=0.5)
    assert first.num_blocks > 0 and second.num_blocks > 0
    assert "x 0.5 (its share)" in first.reason and "in use by this worker" in first.reason
    assert first.kv_bytes <= int(total * 0.9 * 0.5) - weights - peak
    # The second loses at most the first's CUDA context to the device-wide headroom.
    assert second.kv_bytes >= first.kv_bytes - context - 32 * LLAMA3_8B.block_bytes
    assert used_by_first + weights + context + second.kv_bytes + 2 * peak <= total * 0.9 + GIB
    # Each sized from the whole device, the first takes 0.9 of it and the second finds no room.
    greedy = kv_budget_from_memory(
        LLAMA3_8B, DeviceMemory(total, total - weights - context, peak), 0.9, staging_bytes=0)
    with pytest.raises(InvalidRequestError, match="no room"):
        kv_budget_from_memory(
            LLAMA3_8B,
            DeviceMemory(total, total - 2 * (weights + context) - greedy.kv_bytes, peak),
            0.9, staging_bytes=0)


def test_a_share_never_takes_more_than_is_free() -> None:
    """A replica that starts next to a process using most of the device is capped by what is
    free, keeping the device-wide headroom."""
    memory = DeviceMemory(100 * GIB, 20 * GIB, GIB, own_bytes=4 * GIB)
    budget = kv_budget_from_memory(LLAMA3_8B, memory, 0.9, 0, device_share=0.5)
    assert budget.kv_bytes <= 20 * GIB - GIB - 10 * GIB
    assert "capped by the device free memory" in budget.reason

