"""What a worker's KV cache is derived from its settings: the longest sequence, the layout,
the number of blocks, and the cache tensor itself (every caller sizes it through here).

One tensor per worker (per TP rank): [num_layers, 2, num_blocks, *KVLayout.block_dims].
"""

from __future__ import annotations

import torch

from pdserve.engine.kv.layout import DTYPE_BY_NAME, NAME_BY_DTYPE, KVLayout
from pdserve.engine.model_config import ModelConfig

GIB = 1 << 30


def max_model_len_for(config: ModelConfig, requested: int | None) -> int:
    """The longest sequence (prompt + output) served: ``requested`` (model.max_model_len),
    capped by what the model's positions cover; None asks for all of them."""
    return min(requested or config.max_position_embeddings, config.max_position_embeddings)


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """K and V of one token in every layer, in bytes, for a cache of dtype ``dtype`` (a
    DTYPE_BY_NAME key)."""
    return (2 * config.num_layers * config.num_kv_heads * config.head_dim
            * DTYPE_BY_NAME[dtype].itemsize)


def kv_layout_for(
    config: ModelConfig, model_fingerprint: str, dtype: torch.dtype, block_size: int,
    tp_rank: int = 0, tp_size: int = 1,
) -> KVLayout:
    """The layout of the cache of TP rank ``tp_rank`` of ``tp_size`` (a whole model: 0 of 1)."""
    return KVLayout(
        model_fingerprint=model_fingerprint,
        dtype=NAME_BY_DTYPE[dtype],
        block_size=block_size,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        tp_rank=tp_rank,
        tp_size=tp_size,
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
    return max(0, budget_bytes // kv_cache_bytes(layout, 1))


def num_kv_blocks_for(layout: KVLayout, num_kv_blocks: int | None,
                      kv_cache_memory_gb: float) -> int:
    """The cache's block count: ``num_kv_blocks`` when given, else as many as
    ``kv_cache_memory_gb`` holds (at least one)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    return max(1, num_blocks_for_budget(layout, int(kv_cache_memory_gb * GIB)))
