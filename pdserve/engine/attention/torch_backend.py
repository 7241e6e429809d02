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

from pdserve.engine.attention import cpu_native
from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.cpu_native import DecodeItems
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
    # Additive [KVH * g, 1, nb * block_size], rows ordered (KV head, sequence): 0 inside the
    # context, -inf past it.
    mask: torch.Tensor


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
        """A `like`-typed view of `shape` ([n, blocks, ...per block]) over the buffer."""
        numel = math.prod(shape)
        buffer = self._buffer
        if buffer is None or buffer.dtype != like.dtype or buffer.numel() < numel:
            size = max(numel, numel // shape[1] * self.num_blocks)
            buffer = self._buffer = torch.empty(size, dtype=like.dtype, device=like.device)
        return buffer[:numel].view(shape)


@dataclass
class TorchAttentionPlan:
    prefills: tuple[PrefillChunk, ...]
    # The decode rows for pdserve's C kernel (CPU), or None: grouped for batched matmuls.
    native: DecodeItems | None
    decode_groups: tuple[DecodeGroup, ...] | None
    workspace: Workspace
    # What grouping needs if a layer's head shape does not fit the kernel after all.
    metadata: AttentionMetadata
    block_size: int
    num_kv_heads: int
    dtype: torch.dtype

    def groups(self) -> tuple[DecodeGroup, ...]:
        if self.decode_groups is None:
            self.decode_groups = _decode_groups(self.metadata, self.block_size,
                                                self.num_kv_heads, self.dtype)
            largest = max((g.block_ids.numel() for g in self.decode_groups), default=0)
            self.workspace = Workspace(largest)
        return self.decode_groups


class TorchAttentionBackend(AttentionBackend):
    """Reference backend; also the CPU production path.

    On CPU, decode rows go to pdserve's C kernel (`cpu_native`) when it builds and fits the
    layer (``c_kernel=False``: PyTorch ops only, the reference other kernels are tested
    against)."""

    name = "torch"

    def __init__(self, c_kernel: bool = True) -> None:
        self.c_kernel = c_kernel

    def prepare(
        self, metadata: AttentionMetadata, block_size: int, num_kv_heads: int, dtype: torch.dtype
    ) -> TorchAttentionPlan:
        starts = [0, *accumulate(metadata.query_lens)]
        prefills = tuple(
            _prefill_chunk(metadata, s, starts[s], block_size, dtype)
            for s, q_len in enumerate(metadata.query_lens)
            if q_len > 1
        )
        native = None
        if (self.c_kernel and metadata.block_tables.device.type == "cpu"
                and dtype in cpu_native.DTYPES
                and block_size <= cpu_native.MAX_BLOCK and cpu_native.decode_kernel()):
            native = _decode_items(metadata)
        plan = TorchAttentionPlan(prefills, native, None, Workspace(0), metadata, block_size,
                                  num_kv_heads, dtype)
        if native is None:
            plan.groups()
        return plan

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: TorchAttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        kernel = cpu_native.decode_kernel() if plan.native is not None else None
        if kernel is not None and plan.native is not None and layer_cache.dtype == query.dtype \
                and kernel.fits(query.dtype, query.shape[1], layer_cache.shape[3],
                                query.shape[2], layer_cache.shape[2]):
            out = query.new_empty(query.shape)
            if plan.native.count:
                kernel.attend(query, layer_cache, plan.native, out, scale)
            return self._attend_prefills(query, layer_cache, plan, out, scale)
        groups = plan.groups()
        if len(groups) == 1 and groups[0].token_rows is None:
            attended = _attend_decode(query, layer_cache, groups[0], plan.workspace, scale)
            return attended.reshape(query.shape)
        out = query.new_empty(query.shape)
        # Rows viewed per KV head, the layout `_attend_decode` returns (one scatter per group).
        by_kv_head = out.view(query.shape[0], layer_cache.shape[3], -1, query.shape[2])
        for group in groups:
            rows = group.token_rows
            assert rows is not None
            attended = _attend_decode(
                query.index_select(0, rows), layer_cache, group, plan.workspace, scale
            )
            by_kv_head.index_copy_(0, rows, attended)
        return self._attend_prefills(query, layer_cache, plan, out, scale)

    @staticmethod
    def _attend_prefills(query: torch.Tensor, layer_cache: torch.Tensor,
                         plan: TorchAttentionPlan, out: torch.Tensor,
                         scale: float) -> torch.Tensor:
        # Each [num_blocks, block_size, kv_heads, head_dim].
        keys, values = layer_cache[0], layer_cache[1]
        for chunk in plan.prefills:
            out[chunk.start : chunk.stop] = _attend_prefill(
                query[chunk.start : chunk.stop], keys, values, chunk, scale
            )
        return out


def _decode_items(metadata: AttentionMetadata) -> DecodeItems:
    seqs = [s for s, q_len in enumerate(metadata.query_lens) if q_len == 1]
    if len(seqs) == metadata.num_seqs == metadata.num_tokens:
        rows = index = torch.arange(len(seqs))
    else:
        index = torch.tensor(seqs, dtype=torch.int64)
        rows = metadata.query_start_loc.index_select(0, index).long()
    return DecodeItems(index, rows, metadata.block_tables.contiguous(),
                       metadata.seq_lens_tensor.contiguous())


def _decode_groups(metadata: AttentionMetadata, block_size: int, num_kv_heads: int,
                   dtype: torch.dtype) -> tuple[DecodeGroup, ...]:
    decode_seqs = [s for s, q_len in enumerate(metadata.query_lens) if q_len == 1]
    groups = _group_by_length(
        decode_seqs, [-(-metadata.seq_lens[s] // block_size) for s in decode_seqs]
    )
    all_rows = len(decode_seqs) == metadata.num_tokens
    return tuple(
        _decode_group(
            metadata, group, block_size, num_kv_heads, dtype,
            in_order=all_rows and len(groups) == 1,
        )
        for group in groups
    )


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA turns boolean masks into additive ones on every call; do it once per step instead.
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _group_by_length(seqs: list[int], num_blocks: list[int]) -> list[list[int]]:
    """Split `seqs` (with contexts of `num_blocks` blocks) into groups padded to their longest.

    Minimises padded (sequence, block) pairs plus `_GROUP_COST_BLOCKS` per group, exactly, by
    dynamic programming over the sequences sorted by length (a group is a run of that order).
    Cuts fall only where the length changes (moving equal lengths into the shorter group
    never costs more), so the program runs over the distinct lengths, few in a decode batch.
    """
    if not seqs:
        return []
    if min(num_blocks) == max(num_blocks):
        return [seqs]  # batch order: a lone group that covers every row needs no row shuffles
    order = sorted(range(len(seqs)), key=num_blocks.__getitem__)
    widths = [num_blocks[i] for i in order]
    ends = [i for i in range(1, len(order)) if widths[i] != widths[i - 1]] + [len(order)]
    starts = [0, *ends[:-1]]
    best = [0.0] + [math.inf] * len(ends)  # best[j]: cost of the first ends[j - 1] sequences
    cut = [0] * (len(ends) + 1)
    for j, end in enumerate(ends, start=1):
        width = widths[end - 1]
        for i, begin in enumerate(starts):
            if begin >= end:
                break
            cost = best[i] + (end - begin) * width + _GROUP_COST_BLOCKS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups: list[list[int]] = []
    j = len(ends)
    while j:
        groups.append([seqs[k] for k in order[starts[cut[j]] : ends[j - 1]]])
        j = cut[j]
    if len(groups) == 1:
        return [seqs]
    return groups[::-1]


def _decode_group(
    metadata: AttentionMetadata,
    seqs: list[int],
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    in_order: bool,
) -> DecodeGroup:
    device = metadata.block_tables.device
    num_blocks = -(-max(metadata.seq_lens[s] for s in seqs) // block_size)
    table, seq_lens, token_rows = metadata.block_tables, metadata.seq_lens_tensor, None
    if not in_order:
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        table, seq_lens = table.index_select(0, index), seq_lens.index_select(0, index)
        token_rows = metadata.query_start_loc.index_select(0, index).long()
    # Copying whole blocks (not single slots) is the cheap gather; entries past a sequence's
    # own blocks are pad values whose contents the mask hides.
    block_ids = table[:, :num_blocks].flatten().long()
    valid = torch.arange(num_blocks * block_size, device=device)[None, :] < seq_lens[:, None]
    mask = _additive_mask(valid[:, None, :], dtype).repeat(num_kv_heads, 1, 1)
    return DecodeGroup(token_rows=token_rows, block_ids=block_ids, mask=mask)


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

    The context's whole blocks are gathered, then laid out one (KV head, sequence) per row,
    so two batched matmuls cover all heads at once (no head repeat). Measured on the medium
    model in bfloat16 (batch 32): per-head matmuls over the strided gather took 17 % longer
    per step, a gather straight into that layout (strided rows of one head) 8 %, and SDPA's
    CPU kernels, tiled for long queries, several times as long.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    group_size = num_heads // kv_heads
    num_blocks = group.block_ids.numel()
    # [K, V as gathered; K, V by head], in one buffer reused by every layer.
    buffer = workspace.take((4, num_blocks, block_size, kv_heads, head_dim), layer_cache)
    # Along dim 0 of K and V separately: rows of whole blocks, which torch copies in parallel.
    torch.index_select(layer_cache[0], 0, group.block_ids, out=buffer[0])
    torch.index_select(layer_cache[1], 0, group.block_ids, out=buffer[1])
    kv = buffer[2:].view(2, kv_heads, num_blocks, block_size, head_dim)
    kv.copy_(buffer[:2].permute(0, 3, 1, 2, 4))
    kv = kv.view(2, kv_heads * num_seqs, -1, head_dim)  # rows ordered (KV head, sequence)
    q = query.view(num_seqs, kv_heads, group_size, head_dim).transpose(0, 1)
    scores = torch.baddbmm(
        group.mask, q.reshape(kv_heads * num_seqs, group_size, head_dim), kv[0].transpose(1, 2),
        alpha=scale,
    )
    # Low-precision dtypes take the softmax in float32, as transformers does.
    probs = scores.softmax(-1, dtype=torch.float32).to(query.dtype)
    out = torch.bmm(probs, kv[1]).view(kv_heads, num_seqs, group_size, head_dim)
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
    q = query.transpose(0, 1).unsqueeze(0)
    gqa = True
    if query.is_cuda and chunk.mask is not None and k.shape[1] != q.shape[1]:
        # CUDA SDPA's flash and memory-efficient kernels take no mask together with
        # enable_gqa: it would drop to the math kernel (full fp32 score matrices). Repeating
        # K/V to the head count keeps the memory-efficient kernel.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
        enable_gqa=gqa,
    )
    return out.squeeze(0).transpose(0, 1)
