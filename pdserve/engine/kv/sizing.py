"""How many KV blocks a worker gets: a configured size, or on a GPU what is left of the device
after the weights, one step's activations and the handoff staging (pure arithmetic over figures
a device reports, so every branch is tested on CPU with the numbers a GPU would give).

GPU: the cache gets what is left of ``gpu_memory_utilization`` of the device after everything
already in use (weights, other processes), the peak activations of one profiled step at
``max_num_batched_tokens``, and the handoff's staging (vLLM's gpu_memory_utilization, same idea).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.kv.cache import GIB, kv_cache_bytes, num_blocks_for_budget, num_kv_blocks_for
from pdserve.engine.kv.layout import KVLayout


@dataclass(frozen=True)
class DeviceMemory:
    """What a device reported after the weights loaded and one step was profiled."""

    total_bytes: int
    free_bytes: int  # after the profile step's activations were freed
    peak_activation_bytes: int  # the profile step's peak above what was allocated before it
    own_bytes: int = 0  # what this process holds on the device (weights, torch's cache)


@dataclass(frozen=True)
class KVBudget:
    num_blocks: int
    kv_bytes: int
    reason: str  # the arithmetic, for the start-up line


def kv_budget_from_memory(layout: KVLayout, memory: DeviceMemory, utilization: float,
                          staging_bytes: int, device_share: float = 1.0) -> KVBudget:
    """Blocks that fit in ``utilization`` of the device once what is in use, the step's peak
    activations and the staging are set aside. Refuses (naming every figure) when not even one
    block fits.

    A worker that owns ``device_share`` < 1 of its device (colocated replicas with fractional
    GPUs) gets that share of ``utilization`` of it, less only what it holds itself: the other
    replicas on the device spend their own shares. It never takes more than is free with the
    device-wide headroom kept."""
    shared = device_share < 1
    if shared:
        in_use = memory.own_bytes
        allowed = int(memory.total_bytes * utilization * device_share)
    else:
        in_use = memory.total_bytes - memory.free_bytes
        allowed = int(memory.total_bytes * utilization)
    left = max(0, allowed - in_use - memory.peak_activation_bytes - staging_bytes)
    headroom = memory.total_bytes - int(memory.total_bytes * utilization)
    free_left = max(0, memory.free_bytes - memory.peak_activation_bytes - staging_bytes - headroom)
    capped = shared and free_left < left
    if capped:
        left = free_left
    reason = (f"{utilization:.2f} x {_gib(memory.total_bytes)}"
              f"{f' x {device_share:g} (its share)' if shared else ''} = {_gib(allowed)}, minus "
              f"{_gib(in_use)} in use{' by this worker' if shared else ''}, "
              f"{_gib(memory.peak_activation_bytes)} peak activations of one step, "
              f"{_gib(staging_bytes)} staging: {_gib(left)}"
              f"{' (capped by the device free memory)' if capped else ''}")
    num_blocks = num_blocks_for_budget(layout, left)
    if num_blocks < 1:
        raise InvalidRequestError(
            f"no room for the KV cache: {reason}; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens, or the handoff staging")
    return KVBudget(num_blocks, kv_cache_bytes(layout, num_blocks), reason)


def kv_budget_from_size(layout: KVLayout, num_blocks: int | None,
                        memory_gb: float) -> KVBudget:
    """A configured size: ``num_blocks`` when given, else ``memory_gb`` turned into blocks."""
    blocks = num_kv_blocks_for(layout, num_blocks, memory_gb)
    reason = "engine.num_kv_blocks" if num_blocks is not None else f"{memory_gb:g} GiB"
    return KVBudget(blocks, kv_cache_bytes(layout, blocks), reason)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"
