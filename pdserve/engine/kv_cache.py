"""Allocation of the paged KV cache tensor described by a `KVLayout`, and sizing helpers.

One tensor per worker: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.kv_layout import NAME_BY_DTYPE, KVLayout
from pdserve.engine.model_config import ModelConfig


def kv_layout_for(
    config: ModelConfig, model_fingerprint: str, dtype: torch.dtype, block_size: int
) -> KVLayout:
    """The layout of a whole (unsharded) model's cache."""
    return KVLayout(
        model_fingerprint=model_fingerprint,
        dtype=NAME_BY_DTYPE[dtype],
        block_size=block_size,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )


# Provides a worker's host KV memory: called with a byte count, returns a uint8 CPU tensor of
# at least that many bytes (e.g. memory a same-host peer can map, for the KV handoff).
HostMemory = Callable[[int], torch.Tensor]


def allocate_kv_cache(
    layout: KVLayout, num_blocks: int, device: torch.device | str,
    host_memory: HostMemory | None = None,
) -> torch.Tensor:
    """A zeroed cache of shape ``layout.cache_shape(num_blocks)`` and dtype ``layout.dtype``,
    in memory from ``host_memory`` when given (CPU caches only)."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    shape = layout.cache_shape(num_blocks)
    if host_memory is None or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=layout.torch_dtype, device=device)
    nbytes = kv_cache_bytes(layout, num_blocks)
    memory = host_memory(nbytes)
    if memory.dtype != torch.uint8 or memory.device.type != "cpu" or memory.numel() < nbytes:
        raise ValueError(f"host memory provider gave {memory.numel()} {memory.dtype} on "
                         f"{memory.device}, need {nbytes} uint8 bytes on cpu")
    cache = memory[:nbytes].view(layout.torch_dtype).view(shape)
    cache.zero_()
    return cache


def kv_cache_bytes(layout: KVLayout, num_blocks: int) -> int:
    """Bytes that `allocate_kv_cache(layout, num_blocks, ...)` takes."""
    return layout.num_local_layers * layout.block_bytes * num_blocks


def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    """The most blocks that fit in `budget_bytes` (0 when not even one does)."""
    return max(0, budget_bytes // (layout.num_local_layers * layout.block_bytes))
