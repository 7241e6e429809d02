"""Paged attention through flash-attn 2's `flash_attn_varlen_func` with a ``block_table``
(CUDA, fp16/bf16, compute capability >= 8.0).

flash-attn reads a paged cache only when the block size is a multiple of 256; `selection.py`
picks this backend only then (the Triton kernel serves smaller blocks without any copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata

# flash-attn 2.8's varlen kernel refuses a paged cache (block_table) unless the page size is a
# multiple of this (flash_api.cpp, mha_varlen_fwd).
FLASH_PAGED_BLOCK_MULTIPLE = 256
# flash-attn 2 builds kernels for Ampere (sm80) and newer only.
FLASH_MIN_CAPABILITY = (8, 0)
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashAttentionPlan:
    cu_seqlens_k: torch.Tensor  # int32 [S+1]


class FlashAttentionBackend(AttentionBackend):
    """GPU backend. Raises ImportError at construction when flash-attn is not installed."""

    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func  # optional GPU dependency

        self._varlen: Callable[..., torch.Tensor] = flash_attn_varlen_func

    def prepare(
        self, metadata: AttentionMetadata, block_size: int, num_kv_heads: int, dtype: torch.dtype
    ) -> FlashAttentionPlan:
        if block_size % FLASH_PAGED_BLOCK_MULTIPLE:
            raise ValueError(f"flash-attn's paged kernel needs a block size that is a multiple "
                             f"of {FLASH_PAGED_BLOCK_MULTIPLE}, got {block_size}")
        device = metadata.seq_lens_tensor.device
        cu_seqlens_k = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=device)
        torch.cumsum(metadata.seq_lens_tensor, 0, out=cu_seqlens_k[1:])
        return FlashAttentionPlan(cu_seqlens_k=cu_seqlens_k)

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: FlashAttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        return self._varlen(
            query.contiguous(),  # flash-attn's varlen kernels take dense rows
            layer_cache[0], layer_cache[1],
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            # flash-attn aligns the causal mask bottom-right: the queries are the last
            # query_len positions of each context, exactly our layout.
            causal=True,
            block_table=metadata.block_tables,
        )
