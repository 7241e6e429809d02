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
    """All single-token sequences of a step, padded to their longest context."""

    token_rows: torch.Tensor | None  # int64 [Sd] rows of the flat batch; None: all T rows, in order
    slots: torch.Tensor  # int64 [Sd, L] cache slot of each context position (0 where padded)
    valid: torch.Tensor  # bool [Sd, 1, 1, L] True where the position is inside the context


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with several new tokens."""

    start: int  # its rows in the flat batch: [start, stop)
    stop: int
    slots: torch.Tensor  # int64 [seq_len] cache slot of each context position
    allowed: torch.Tensor | None  # bool [query_len, seq_len]; None when plain causal (no cached prefix)


@dataclass(frozen=True)
class TorchAttentionPlan:
    decode: DecodeRows | None
    prefills: tuple[PrefillChunk, ...]


class TorchAttentionBackend(AttentionBackend):
    """Reference backend; also the CPU production path."""

    name = "torch"

    def prepare(self, metadata: AttentionMetadata, block_size: int) -> TorchAttentionPlan:
        decode_seqs = [s for s, q_len in enumerate(metadata.query_lens) if q_len == 1]
        starts = [0, *accumulate(metadata.query_lens)]
        prefills = tuple(
            _prefill_chunk(metadata, s, starts[s], block_size)
            for s, q_len in enumerate(metadata.query_lens)
            if q_len > 1
        )
        decode = _decode_rows(metadata, decode_seqs, block_size) if decode_seqs else None
        return TorchAttentionPlan(decode=decode, prefills=prefills)

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: TorchAttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        num_blocks, block_size, kv_heads, head_dim = layer_cache.shape[1:]
        keys = layer_cache[0].view(num_blocks * block_size, kv_heads, head_dim)
        values = layer_cache[1].view(num_blocks * block_size, kv_heads, head_dim)
        decode = plan.decode
        if decode is not None and decode.token_rows is None:
            return _attend_decode(query, keys, values, decode, scale)
        out = torch.empty_like(query)
        if decode is not None:
            rows = decode.token_rows
            assert rows is not None
            out.index_copy_(0, rows, _attend_decode(query.index_select(0, rows), keys, values, decode, scale))
        for chunk in plan.prefills:
            out[chunk.start : chunk.stop] = _attend_prefill(
                query[chunk.start : chunk.stop], keys, values, chunk, scale
            )
        return out


def _decode_rows(metadata: AttentionMetadata, seqs: list[int], block_size: int) -> DecodeRows:
    device = metadata.block_tables.device
    all_rows = len(seqs) == metadata.num_tokens
    index = torch.tensor(seqs, dtype=torch.int64, device=device)
    tables = metadata.block_tables.index_select(0, index).long()
    seq_lens = metadata.seq_lens_tensor.index_select(0, index).long()
    longest = max(metadata.seq_lens[s] for s in seqs)
    positions = torch.arange(longest, device=device)
    slots = tables[:, positions // block_size] * block_size + positions % block_size
    valid = positions[None, :] < seq_lens[:, None]
    # Padded positions may point at pad entries of the block table: send them to slot 0, masked.
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    token_rows = None if all_rows else metadata.query_start_loc.index_select(0, index).long()
    return DecodeRows(token_rows=token_rows, slots=slots, valid=valid[:, None, None, :])


def _prefill_chunk(metadata: AttentionMetadata, seq: int, start: int, block_size: int) -> PrefillChunk:
    device = metadata.block_tables.device
    q_len, seq_len = metadata.query_lens[seq], metadata.seq_lens[seq]
    num_blocks = -(-seq_len // block_size)
    blocks = metadata.block_tables[seq, :num_blocks].long()
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:seq_len]
    allowed = None
    if q_len < seq_len:
        # Query i sits at position seq_len - q_len + i and may see keys up to that position.
        last_visible = torch.arange(seq_len - q_len, seq_len, device=device)
        allowed = torch.arange(seq_len, device=device)[None, :] <= last_visible[:, None]
    return PrefillChunk(start=start, stop=start + q_len, slots=slots, allowed=allowed)


def _attend_decode(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, decode: DecodeRows, scale: float
) -> torch.Tensor:
    """query [Sd, H, D] -> [Sd, H, D]: one query per sequence against its padded context."""
    k = keys[decode.slots].transpose(1, 2)  # [Sd, KVH, L, D]
    v = values[decode.slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), k, v, attn_mask=decode.valid, scale=scale, enable_gqa=True
    )  # [Sd, H, 1, D]
    return out.squeeze(2)


def _attend_prefill(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """query [q, H, D] -> [q, H, D] against the sequence's whole context."""
    k = keys[chunk.slots].transpose(0, 1)  # [KVH, L, D]
    v = values[chunk.slots].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        k,
        v,
        attn_mask=chunk.allowed,
        is_causal=chunk.allowed is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
