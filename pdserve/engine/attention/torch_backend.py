"""Paged attention in plain PyTorch: runs on CPU and CUDA, any dtype.

Decode rows (query_len 1) are grouped by context length and attended with batched matmuls;
prefill chunks run per sequence through scaled_dot_product_attention with a causal offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata

# What one more decode group costs, in padded (sequence, block) pairs: each group adds about
# ten kernel launches per layer, each a thread-pool barrier that stalls on a busy CPU. At 64,
# a spread of context lengths (64-1,152) takes ~3 groups and ~16% padding (one group: ~58%);
# measured on the small model at 2 threads, 32-128 are within noise of each other.
_GROUP_COST_BLOCKS = 64


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token sequences padded together to their longest context (in whole blocks)."""

    token_rows: torch.Tensor | None  # int64 [g] rows of the flat batch; None: all T rows, in order
    block_ids: torch.Tensor  # int64 [g * nb] cache blocks, row after row (pad entries are masked)
    mask: torch.Tensor  # additive [g, 1, nb * block_size]: 0 inside the context, -inf past it


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with several new tokens."""

    start: int  # its rows in the flat batch: [start, stop)
    stop: int
    seq_len: int
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)] cache blocks of the context
    mask: torch.Tensor | None  # additive [query_len, seq_len] causal mask; None: no cached prefix


class Workspace:
    """Scratch memory for gathered K/V, reused by every group of every layer of one step.

    Large fresh CPU allocations page-fault on first touch, which cost more than the gather
    itself; one buffer per step (not per layer) avoids that. Per step, so threads that share
    a model never share a buffer.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks  # of the largest group: one allocation serves them all
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A `like`-typed view of `shape` ([2, blocks, ...per block]) over the buffer."""
        numel = math.prod(shape)
        buffer = self._buffer
        if buffer is None or buffer.dtype != like.dtype or buffer.numel() < numel:
            size = max(numel, 2 * self.num_blocks * math.prod(shape[2:]))
            buffer = self._buffer = torch.empty(size, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape)


@dataclass(frozen=True)
class TorchAttentionPlan:
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    workspace: Workspace


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
        groups = _group_by_length(
            decode_seqs, [-(-metadata.seq_lens[s] // block_size) for s in decode_seqs]
        )
        all_rows = len(decode_seqs) == metadata.num_tokens
        decode_groups = tuple(
            _decode_group(
                metadata, group, block_size, dtype, in_order=all_rows and len(groups) == 1
            )
            for group in groups
        )
        largest = max((g.block_ids.numel() for g in decode_groups), default=0)
        return TorchAttentionPlan(decode_groups, prefills, Workspace(largest))

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: TorchAttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        groups = plan.decode_groups
        if len(groups) == 1 and groups[0].token_rows is None:
            attended = _attend_decode(query, layer_cache, groups[0], plan.workspace, scale)
            return attended.reshape(query.shape)
        out = torch.empty_like(query)
        # Rows viewed per KV head, the layout `_attend_decode` returns (one scatter per group).
        by_kv_head = out.view(query.shape[0], layer_cache.shape[3], -1, query.shape[2])
        for group in groups:
            rows = group.token_rows
            assert rows is not None
            attended = _attend_decode(
                query.index_select(0, rows), layer_cache, group, plan.workspace, scale
            )
            by_kv_head.index_copy_(0, rows, attended)
        # Each [num_blocks, block_size, kv_heads, head_dim].
        keys, values = layer_cache[0], layer_cache[1]
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


def _group_by_length(seqs: list[int], num_blocks: list[int]) -> list[list[int]]:
    """Split `seqs` (with contexts of `num_blocks` blocks) into groups padded to their longest.

    Minimises padded (sequence, block) pairs plus `_GROUP_COST_BLOCKS` per group, exactly, by
    dynamic programming over the sequences sorted by length (a group is a run of that order).
    """
    if not seqs:
        return []
    order = sorted(range(len(seqs)), key=num_blocks.__getitem__)
    widths = [num_blocks[i] for i in order]
    best = [0] + [math.inf] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        width = widths[end - 1]
        for begin in range(end):
            cost = best[begin] + (end - begin) * width + _GROUP_COST_BLOCKS
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    groups: list[list[int]] = []
    end = len(order)
    while end:
        groups.append([seqs[i] for i in order[cut[end] : end]])
        end = cut[end]
    if len(groups) == 1:
        return [seqs]  # batch order: a lone group that covers every row needs no row shuffles
    return groups[::-1]


def _decode_group(
    metadata: AttentionMetadata,
    seqs: list[int],
    block_size: int,
    dtype: torch.dtype,
    in_order: bool,
) -> DecodeGroup:
    device = metadata.block_tables.device
    index = torch.tensor(seqs, dtype=torch.int64, device=device)
    longest = max(metadata.seq_lens[s] for s in seqs)
    num_blocks = -(-longest // block_size)
    # Copying whole blocks (not single slots) is the cheap gather; entries past a sequence's
    # own blocks are pad values whose contents the mask hides.
    block_ids = metadata.block_tables.index_select(0, index)[:, :num_blocks].long().flatten()
    seq_lens = metadata.seq_lens_tensor.index_select(0, index).long()
    valid = torch.arange(num_blocks * block_size, device=device)[None, :] < seq_lens[:, None]
    token_rows = None if in_order else metadata.query_start_loc.index_select(0, index).long()
    return DecodeGroup(
        token_rows=token_rows, block_ids=block_ids, mask=_additive_mask(valid[:, None, :], dtype)
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
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    group: DecodeGroup,
    workspace: Workspace,
    scale: float,
) -> torch.Tensor:
    """query [g, H, D] -> [g, KVH, H / KVH, D] (a strided view): one query per sequence
    against its padded context.

    Two batched matmuls per KV head, the K/V read in place from one gather (no head repeat):
    for a single query row they beat SDPA's CPU kernels, which tile for long queries.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    kv = workspace.take((2, group.block_ids.numel(), block_size, kv_heads, head_dim), layer_cache)
    # Along dim 0 of K and V separately: rows of whole blocks, which torch copies in parallel
    # (a gather along dim 1 of the joint tensor runs on one thread).
    torch.index_select(layer_cache[0], 0, group.block_ids, out=kv[0])
    torch.index_select(layer_cache[1], 0, group.block_ids, out=kv[1])
    kv = kv.view(2, num_seqs, -1, kv_heads, head_dim)  # [2, g, L, KVH, D]
    q = query.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = query.new_empty((kv_heads, num_seqs, num_heads // kv_heads, head_dim))
    for h in range(kv_heads):
        scores = torch.baddbmm(group.mask, q[:, h], kv[0, :, :, h].transpose(1, 2), alpha=scale)
        # Low-precision dtypes take the softmax in float32, as transformers does.
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        torch.bmm(probs, kv[1, :, :, h], out=out[h])
    return out.transpose(0, 1)


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
