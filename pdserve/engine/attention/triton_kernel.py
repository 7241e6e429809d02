"""A Triton kernel for causal attention over the paged KV cache, any block size, any GQA ratio.

One kernel serves decode rows, whole prompts and prompt chunks after a cached prefix: the queries
of a sequence are always the last ``query_len`` positions of its ``seq_len``-token context.
A batch of few short query tiles over long contexts splits each context among programs
(`launch_shape`), and a second kernel combines their partial softmaxes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Query rows per program: (query token, head of the KV head's group) pairs. 16 is the smallest
# tile tl.dot takes, and a decode row of a GQA group (4-8 heads) fills most of it. A prompt
# chunk takes 64-row tiles: each program reads the context's K/V once for 64 rows, not 16.
BLOCK_M = 16
PREFILL_BLOCK_M = 64
# Context tokens per inner step, gathered token by token through the block table, so the
# cache's block size never has to match a tile.
BLOCK_N = 32
# A context split among programs gives each at least this many tokens (a split's partial
# result costs a write and a combine; below this the split costs more than it spreads).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, lse_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
    scale,
    stride_q_token, stride_q_head,
    stride_out_split, stride_out_token, stride_out_head,
    stride_lse_split, stride_lse_token,
    stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    block_size,
    head_dim,
    num_splits,
    kv_chunk,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One (sequence, KV head, query tile, context split) per program. Unsplit, it writes the
    tile's output; split, the split's normalised partial output and its log-sum-exp."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row r: query token r // GROUP, head r % GROUP
    if tile * BLOCK_M < q_len * GROUP:
        token = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = token < q_len
        position = seq_len - q_len + token  # the query's own position in its context
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < head_dim
        q = tl.load(
            q_ptr + (q_start + token)[:, None] * stride_q_token
            + head[:, None] * stride_q_head + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        )
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys past the tile's last query are masked for every row: stop there.
        last_token = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
        kv_end = seq_len - q_len + last_token + 1
        kv_lo = split * kv_chunk
        kv_end = tl.minimum(kv_end, kv_lo + kv_chunk)
        for kv_start in range(kv_lo, kv_end, BLOCK_N):
            keys = kv_start + tl.arange(0, BLOCK_N)
            key_ok = keys < kv_end
            blocks = tl.load(block_tables_ptr + seq * stride_table_seq + keys // block_size,
                             mask=key_ok, other=0)
            slots = blocks.to(tl.int64) * block_size + keys % block_size
            offsets = (slots[:, None] * stride_cache_slot + kv_head * stride_cache_head
                       + dims[None, :])
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(cache_ptr + offsets, mask=kv_mask, other=0.0)
            v = tl.load(cache_ptr + stride_cache_kv + offsets, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            visible = (keys[None, :] <= position[:, None]) & key_ok[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # Rows with nothing visible yet keep -inf maxima: exp of (-inf) - (-inf) is NaN.
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            correction = tl.exp(row_max - safe_max)
            probs = tl.exp(scores - safe_max[:, None])
            row_sum = row_sum * correction + tl.sum(probs, 1)
            acc = acc * correction[:, None] + tl.dot(
                probs.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            row_max = new_max
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr + split * stride_out_split + (q_start + token)[:, None] * stride_out_token
            + head[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        if SPLIT:  # a split that saw no key has weight 0 in the combine
            lse = tl.where(row_sum == 0.0, float("-inf"),
                           row_max + tl.log(tl.where(row_sum == 0.0, 1.0, row_sum)))
            tl.store(lse_ptr + split * stride_lse_split + (q_start + token) * stride_lse_token
                     + head, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_part_split, stride_part_token, stride_part_head,
    stride_lse_split, stride_lse_token,
    stride_out_token, stride_out_head,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (query token, head) per program: the splits' outputs weighted by their share of
    the softmax's denominator."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    lse = tl.load(lse_ptr + splits * stride_lse_split + token * stride_lse_token + head,
                  mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weights, 0)
    parts = tl.load(part_ptr + splits[:, None] * stride_part_split + token * stride_part_token
                    + head * stride_part_head + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass(frozen=True)
class LaunchShape:
    """Query rows per program, and how many programs share each context (tokens each)."""

    block_m: int
    num_splits: int
    kv_chunk: int


def launch_shape(num_seqs: int, num_kv_heads: int, group: int, max_query_len: int,
                 max_seq_len: int, num_programs_wanted: int) -> LaunchShape:
    """Tiles and splits for a batch. Prompt chunks (more query rows than a small tile) take
    the large tile and no split: their tiles already fill the device. Decode-shaped batches
    whose (sequence, KV head) programs number fewer than ``num_programs_wanted`` split each
    context in chunks of at least `MIN_SPLIT_TOKENS` until they do."""
    rows = max_query_len * group
    if rows > BLOCK_M:
        return LaunchShape(PREFILL_BLOCK_M, 1, max_seq_len)
    programs = num_seqs * num_kv_heads
    splits = min(MAX_SPLITS, -(-num_programs_wanted // programs),
                 max(1, max_seq_len // MIN_SPLIT_TOKENS))
    if splits <= 1:
        return LaunchShape(BLOCK_M, 1, max_seq_len)
    chunk = -(-max_seq_len // splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N  # whole inner steps
    return LaunchShape(BLOCK_M, -(-max_seq_len // chunk), chunk)


def paged_attention(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    shape: LaunchShape | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, head_dim]`` (rows contiguous in the last
    dimension) over ``layer_cache`` ``[2, num_blocks, block_size, kv_heads, head_dim]``.

    Sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s + 1])``, which are
    the last positions of its ``seq_lens[s]``-token context, stored in the cache blocks
    ``block_tables[s]``. ``shape``: tiles and splits (default: `launch_shape` for the device).
    Returns ``[T, heads, head_dim]`` in the query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = layer_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit cache {tuple(layer_cache.shape)}")
    if query.stride(2) != 1 or not layer_cache.is_contiguous():
        raise ValueError("paged_attention needs the query's last dimension and the cache "
                         "contiguous")
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if shape is None:
        shape = launch_shape(num_seqs, num_kv_heads, group, max_query_len, max_seq_len,
                             _programs_wanted(query.device))
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    split = shape.num_splits > 1
    # Split: partial outputs in float32 (they are summed again) and their log-sum-exps.
    part = (torch.empty((shape.num_splits, *query.shape), dtype=torch.float32,
                        device=query.device) if split else out.unsqueeze(0))
    lse = torch.empty((shape.num_splits, num_tokens, num_heads), dtype=torch.float32,
                      device=query.device) if split else part
    block_d = max(16, triton.next_power_of_2(head_dim))
    grid = (num_seqs, num_kv_heads,
            triton.cdiv(max_query_len * group, shape.block_m) * shape.num_splits)
    _paged_attention_kernel[grid](
        query, layer_cache, part, lse, block_tables, query_start_loc, seq_lens,
        scale,
        query.stride(0), query.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        layer_cache.stride(0), layer_cache.stride(2), layer_cache.stride(3),
        block_tables.stride(0),
        block_size,
        head_dim,
        shape.num_splits,
        shape.kv_chunk,
        GROUP=group,
        BLOCK_M=shape.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        # float32 models get float32 products (tf32 would break parity with the torch path).
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SPLIT=split,
    )
    if split:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part, lse, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            shape.num_splits,
            head_dim,
            BLOCK_S=triton.next_power_of_2(shape.num_splits),
            BLOCK_D=block_d,
        )
    return out


def _programs_wanted(device: torch.device) -> int:
    """Two programs per streaming multiprocessor keep a GPU busy; the interpreter runs
    programs one after another, so on CPU one program per (sequence, KV head) is best."""
    if device.type != "cuda":
        return 1
    return 2 * _multiprocessors(device.index if device.index is not None
                                else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    """Asked once per device, not on every layer's call."""
    return torch.cuda.get_device_properties(index).multi_processor_count
