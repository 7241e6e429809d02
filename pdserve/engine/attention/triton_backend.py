"""Paged attention through pdserve's own Triton kernel (`triton_kernel.py`): CUDA at any block
size, and CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it).

The kernel reads K/V through the block table in place: no context is gathered or copied.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Raises ImportError at construction when Triton is not installed."""

    name = "triton"

    def __init__(self) -> None:
        from pdserve.engine.attention.triton_kernel import paged_attention

        self._kernel = paged_attention

    def prepare(
        self, metadata: AttentionMetadata, block_size: int, num_kv_heads: int, dtype: torch.dtype
    ) -> None:
        return None  # the metadata's own tensors are all the kernel reads

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: Any,
        scale: float,
    ) -> torch.Tensor:
        return self._kernel(
            query, layer_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens_tensor, metadata.max_query_len, metadata.max_seq_len, scale,
        )
