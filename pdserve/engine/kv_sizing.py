"""How many KV blocks a worker gets, and how much handoff staging: pure arithmetic over the
layout and memory figures, so every branch is tested on CPU with the numbers a GPU would report.

GPU: the cache gets what is left of ``gpu_memory_utilization`` of the device after everything
already in use (weights, other processes), the peak activations of one profiled step at
``max_num_batched_tokens``, and the handoff's staging (vLLM's gpu_memory_utilization, same idea).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.kv_layout import KVLayout

GIB = 1 << 30
# Staging below this is all per-piece overhead; a handful of small pieces fits even a tiny model.
MIN_STAGING_BYTES = 1 << 20
# Without a device to measure (CPU) and without a configured size, the cache takes this much.
CPU_DEFAULT_KV_GB = 0.5


def kv_bytes_per_token(layout: KVLayout) -> int:
    """K and V of one token, every local layer."""
    return layout.num_local_layers * layout.block_bytes // layout.block_size


def default_staging_bytes(layout: KVLayout, max_num_batched_tokens: int) -> int:
    """One engine step's worth of KV (what a step can hand the sender at once), at least
    `MIN_STAGING_BYTES`. Staging bounds bytes in flight, not the size of a transfer."""
    return max(MIN_STAGING_BYTES, kv_bytes_per_token(layout) * max_num_batched_tokens)


@dataclass(frozen=True)
class DeviceMemory:
    """What a device reported after the weights loaded and one step was profiled."""

    total_bytes: int
    free_bytes: int  # after the profile step's activations were freed
    peak_activation_bytes: int  # the profile step's peak above what was allocated before it


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    kv_bytes: int
    reason: str  # the arithmetic, for the start-up line


def kv_budget_from_memory(layout: KVLayout, memory: DeviceMemory, utilization: float,
                          staging_bytes: int) -> KVBudget:
    """Blocks that fit in ``utilization`` of the device once what is in use, the step's peak
    activations and the staging are set aside. Refuses (naming every figure) when not even one
    block fits."""
    if not 0 < utilization <= 1:
        raise InvalidRequestError(f"gpu_memory_utilization must lie in (0, 1], got {utilization}")
    in_use = memory.total_bytes - memory.free_bytes
    allowed = int(memory.total_bytes * utilization)
    left = allowed - in_use - memory.peak_activation_bytes - staging_bytes
    per_block = layout.num_local_layers * layout.block_bytes
    num_blocks = max(0, left) // per_block
    reason = (f"{utilization:.2f} x {_gib(memory.total_bytes)} = {_gib(allowed)}, minus "
              f"{_gib(in_use)} in use, {_gib(memory.peak_activation_bytes)} peak activations "
              f"of one step, {_gib(staging_bytes)} staging: {_gib(max(0, left))}")
    if num_blocks < 1:
        raise InvalidRequestError(
            f"no room for the KV cache: {reason}; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens, or the handoff staging")
    return KVBudget(num_blocks, num_blocks * per_block, reason)


def kv_budget_from_size(layout: KVLayout, num_blocks: int | None,
                        memory_gb: float | None) -> KVBudget:
    """A configured size: a block count, or GiB turned into blocks (CPU default without one)."""
    per_block = layout.num_local_layers * layout.block_bytes
    if num_blocks is not None:
        return KVBudget(num_blocks, num_blocks * per_block, "engine.num_kv_blocks")
    gb = CPU_DEFAULT_KV_GB if memory_gb is None else memory_gb
    blocks = max(1, int(gb * GIB) // per_block)
    source = "engine.kv_cache_memory_gb" if memory_gb is not None else "the CPU default"
    return KVBudget(blocks, blocks * per_block, f"{gb:g} GiB from {source}")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"
