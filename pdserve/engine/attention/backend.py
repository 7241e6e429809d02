"""The contract between model layers and an attention implementation over the paged KV cache.

A backend writes a layer's new K/V into its cache slice and attends over each sequence's context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pdserve.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over one layer's cache ``[2, num_blocks, block_size, kv_heads, head_dim]``.

    Per forward step the model calls `prepare` once, then per layer `write_kv` followed by
    `attend`. `prepare` turns the step's metadata into whatever index tensors the backend
    needs, so layers do not recompute them.
    """

    name: str = "abstract"

    @abstractmethod
    def prepare(
        self, metadata: AttentionMetadata, block_size: int, num_kv_heads: int, dtype: torch.dtype
    ) -> Any:
        """Per-step plan for queries of `dtype`, computed once and handed to `attend` per layer."""

    def write_kv(
        self,
        layer_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Store new K and V ``[T, kv_heads, head_dim]`` at ``metadata.slot_mapping``."""
        num_blocks, block_size, kv_heads, head_dim = layer_cache.shape[1:]
        flat = layer_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
        flat[0].index_copy_(0, metadata.slot_mapping, key.to(layer_cache.dtype))
        flat[1].index_copy_(0, metadata.slot_mapping, value.to(layer_cache.dtype))

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: Any,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of `query` ``[T, heads, head_dim]`` over each sequence's cached context.

        `query` may be a strided view (its last dimension contiguous), as sliced out of the
        fused q/k/v projection.

        The new tokens' K/V must already be in `layer_cache`. Returns ``[T, heads, head_dim]``.
        """
