"""Allocation of the paged KV cache tensor described by a `KVLayout`, and sizing helpers.

One tensor per worker: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

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


def allocate_kv_cache(layout: KVLayout, num_blocks: int,
                      device: torch.device | str) -> torch.Tensor:
    """A zeroed cache of shape ``layout.cache_shape(num_blocks)`` and dtype ``layout.dtype``."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    return torch.zeros(layout.cache_shape(num_blocks), dtype=layout.torch_dtype, device=device)


def kv_cache_bytes(layout: KVLayout, num_blocks: int) -> int:
    """Bytes that `allocate_kv_cache(layout, num_blocks, ...)` takes."""
    return layout.num_local_layers * layout.block_bytes * num_blocks


def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    """The most blocks that fit in `budget_bytes` (0 when not even one does)."""
    return max(0, budget_bytes // (layout.num_local_layers * layout.block_bytes))
