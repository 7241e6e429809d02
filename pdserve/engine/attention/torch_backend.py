"""Paged attention in plain PyTorch: runs on CPU and CUDA, any dtype.

Decode rows (query_len 1) are batched into one padded, masked attention; prefill chunks run
per sequence through scaled_dot_product_attention with the causal offset of their cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class DecodeRows:
    """All single-token sequences of a step, padded to their longest context (in whole blocks)."""

    token_rows: torch.Tensor | None  # int64 [Sd] rows of the flat batch; None: all T rows, in order
    block_ids: torch.Tensor  # int64 [Sd * nb] cache blocks, row after row (pad entries are masked)
    mask: torch.Tensor  # additive [Sd, 1, 1, nb * block_size]: 0 inside the context, -inf past it


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with several new tokens."""

    start: int  # its rows in the flat batch: [start, stop)
    stop: int
    seq_len: int
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)] cache blocks of the context
    mask: torch.Tensor | None  # additive [query_len, seq_len] causal mask; None: no cached prefix


@dataclass(frozen=True)
class TorchAttentionPlan:
    decode: DecodeRows | None
    prefills: tuple[PrefillChunk, ...]


class TorchAttentionBackend(AttentionBackend):
    """Reference backend; also the CPU production path."""

    name = "torch"

    def prepare(
        self, metadata: AttentionMetadata, block_size: int, dtype: torch.dtype
    ) -> TorchAttentionPlan:
        decode_seqs = [s for s, q_len in enumerate(metadata.query_lens) if q_len == 1]
        starts = [0, *accumulate(metadata.query_lens)]
        prefills = tuple(
            _prefill_chunk(metadata, s, starts[s], block_size, dtype)
            for s, q_len in enumerate(metadata.query_lens)
            if q_len > 1
        )
        decode = _decode_rows(metadata, decode_seqs, block_size, dtype) if decode_seqs else None
        return TorchAttentionPlan(decode=decode, prefills=prefills)

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: TorchAttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        # Each [num_blocks, block_size, kv_heads, head_dim].
        keys, values = layer_cache[0], layer_cache[1]
        decode = plan.decode
        if decode is not None and decode.token_rows is None:
            return _attend_decode(query, keys, values, decode, scale)
        out = torch.empty_like(query)
        if decode is not None:
            rows = decode.token_rows
            assert rows is not None
            out.index_copy_(
                0, rows, _attend_decode(query.index_select(0, rows), keys, values, decode, scale)
            )
        for chunk in plan.prefills:
            out[chunk.start : chunk.stop] = _attend_prefill(
                query[chunk.start : chunk.stop], keys, values, chunk, scale
            )
        return out


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns boolean masks into additive ones on every call; do it once per step instead.
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _decode_rows(
    metadata: AttentionMetadata, seqs: list[int], block_size: int, dtype: torch.dtype
) -> DecodeRows:
    device = metadata.block_tables.device
    index = torch.tensor(seqs, dtype=torch.int64, device=device)
    longest = max(metadata.seq_lens[s] for s in seqs)
    num_blocks = -(-longest // block_size)
    # Copying whole blocks (not single slots) is the cheap gather; entries past a sequence's
    # own blocks are pad values whose contents the mask hides.
    block_ids = metadata.block_tables.index_select(0, index)[:, :num_blocks].long().flatten()
    seq_lens = metadata.seq_lens_tensor.index_select(0, index).long()
    valid = torch.arange(num_blocks * block_size, device=device)[None, :] < seq_lens[:, None]
    all_rows = len(seqs) == metadata.num_tokens
    token_rows = None if all_rows else metadata.query_start_loc.index_select(0, index).long()
    return DecodeRows(
        token_rows=token_rows,
        block_ids=block_ids,
        mask=_additive_mask(valid[:, None, None, :], dtype),
    )


def _prefill_chunk(
    metadata: AttentionMetadata, seq: int, start: int, block_size: int, dtype: torch.dtype
) -> PrefillChunk:
    device = metadata.block_tables.device
    q_len, seq_len = metadata.query_lens[seq], metadata.seq_lens[seq]
    block_ids = metadata.block_tables[seq, : -(-seq_len // block_size)].long()
    mask = None
    if q_len < seq_len:
        # Query i sits at position seq_len - q_len + i and may see keys up to that position.
        last_visible = torch.arange(seq_len - q_len, seq_len, device=device)
        allowed = torch.arange(seq_len, device=device)[None, :] <= last_visible[:, None]
        mask = _additive_mask(allowed, dtype)
    return PrefillChunk(
        start=start, stop=start + q_len, seq_len=seq_len, block_ids=block_ids, mask=mask
    )


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * block_size, kv_heads, head_dim] copy of the given blocks, in order."""
    return cache.index_select(0, block_ids).flatten(0, 1)


def _attend_decode(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, decode: DecodeRows, scale: float
) -> torch.Tensor:
    """query [Sd, H, D] -> [Sd, H, D]: one query per sequence against its padded context."""
    num_seqs = query.shape[0]
    k = (
        _gather(keys, decode.block_ids).unflatten(0, (num_seqs, -1)).transpose(1, 2)
    )  # [Sd, KVH, L, D]
    v = _gather(values, decode.block_ids).unflatten(0, (num_seqs, -1)).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), k, v, attn_mask=decode.mask, scale=scale, enable_gqa=True
    )  # [Sd, H, 1, D]
    return out.squeeze(2)


def _attend_prefill(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """query [q, H, D] -> [q, H, D] against the sequence's whole context."""
    # 4-D inputs: with 3-D ones CPU SDPA falls back to its (10x slower) math kernel.
    k = (
        _gather(keys, chunk.block_ids)[: chunk.seq_len].transpose(0, 1).unsqueeze(0)
    )  # [1, KVH, L, D]
    v = _gather(values, chunk.block_ids)[: chunk.seq_len].transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        k,
        v,
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
