"""Paged attention through flash-attn 2's `flash_attn_varlen_func` (CUDA, fp16/bf16 only).

Upstream flash-attn reads a paged cache only when the block size is a multiple of 256; for
smaller blocks this backend gathers each sequence's context into a contiguous buffer first.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata

# flash-attn 2 rejects paged KV (block_table) unless the page size is a multiple of this.
PAGED_BLOCK_MULTIPLE = 256


@dataclass(frozen=True)
class FlashAttentionPlan:
    cu_seqlens_k: torch.Tensor  # int32 [S+1]
    context_slots: torch.Tensor | None  # int64 [sum(seq_lens)] when gathering; None when paged


class FlashAttentionBackend(AttentionBackend):
    """GPU backend. Raises ImportError at construction when flash-attn is not installed."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func  # optional GPU dependency

        self._varlen: Callable[..., torch.Tensor] = flash_attn_varlen_func
        self._supports_block_table = (
            "block_table" in inspect.signature(flash_attn_varlen_func).parameters
        )

    def prepare(
        self, metadata: AttentionMetadata, block_size: int, num_kv_heads: int, dtype: torch.dtype
    ) -> FlashAttentionPlan:
        device = metadata.seq_lens_tensor.device
        cu_seqlens_k = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=device)
        torch.cumsum(metadata.seq_lens_tensor, 0, out=cu_seqlens_k[1:])
        paged = self._supports_block_table and block_size % PAGED_BLOCK_MULTIPLE == 0
        slots = None if paged else _context_slots(metadata, cu_seqlens_k, block_size)
        return FlashAttentionPlan(cu_seqlens_k=cu_seqlens_k, context_slots=slots)

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: FlashAttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        query = query.contiguous()  # flash-attn's varlen kernels take dense rows
        common: dict[str, Any] = {
            "cu_seqlens_q": metadata.query_start_loc,
            "cu_seqlens_k": plan.cu_seqlens_k,
            "max_seqlen_q": metadata.max_query_len,
            "max_seqlen_k": metadata.max_seq_len,
            "softmax_scale": scale,
            # flash-attn aligns the causal mask bottom-right: the queries are the last
            # query_len positions of each context, exactly our layout.
            "causal": True,
        }
        if plan.context_slots is None:
            return self._varlen(
                query, layer_cache[0], layer_cache[1], block_table=metadata.block_tables, **common
            )
        num_blocks, block_size, kv_heads, head_dim = layer_cache.shape[1:]
        flat = layer_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
        keys = flat[0].index_select(0, plan.context_slots)
        values = flat[1].index_select(0, plan.context_slots)
        return self._varlen(query, keys, values, **common)


def _context_slots(
    metadata: AttentionMetadata, cu_seqlens_k: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slot of every context position of every sequence, sequence after sequence."""
    device = cu_seqlens_k.device
    total = sum(metadata.seq_lens)
    seq_of_position = torch.repeat_interleave(
        torch.arange(metadata.num_seqs, device=device),
        metadata.seq_lens_tensor.long(),
        output_size=total,
    )
    positions = torch.arange(total, device=device) - cu_seqlens_k[:-1].long()[seq_of_position]
    blocks = metadata.block_tables.long()[seq_of_position, positions // block_size]
    return blocks * block_size + positions % block_size
