"""A Triton kernel for causal attention over the paged KV cache, any block size, any GQA ratio.

One kernel serves decode rows, whole prompts and prompt chunks after a cached prefix: the queries
of a sequence are always the last ``query_len`` positions of its ``seq_len``-token context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows per program: (query token, head of the KV head's group) pairs. 16 is the smallest
# tile tl.dot takes, and a decode row of a GQA group (4-8 heads) fills most of it.
BLOCK_M = 16
# Context tokens per inner step, gathered token by token through the block table, so the
# cache's block size never has to match a tile.
BLOCK_N = 32


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
    scale,
    stride_q_token, stride_q_head,
    stride_out_token, stride_out_head,
    stride_cache_kv, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
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
        for kv_start in range(0, kv_end, BLOCK_N):
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
            out_ptr + (q_start + token)[:, None] * stride_out_token
            + head[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def paged_attention(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, head_dim]`` (rows contiguous in the last
    dimension) over ``layer_cache`` ``[2, num_blocks, block_size, kv_heads, head_dim]``.

    Sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s + 1])``, which are
    the last positions of its ``seq_lens[s]``-token context, stored in the cache blocks
    ``block_tables[s]``. Returns ``[T, heads, head_dim]`` in the query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = layer_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit cache {tuple(layer_cache.shape)}")
    if query.stride(2) != 1 or not layer_cache.is_contiguous():
        raise ValueError("paged_attention needs the query's last dimension and the cache "
                         "contiguous")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len * group, BLOCK_M))
    _paged_attention_kernel[grid](
        query, layer_cache, out, block_tables, query_start_loc, seq_lens,
        scale,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        layer_cache.stride(0), layer_cache.stride(2), layer_cache.stride(3),
        block_tables.stride(0),
        block_size,
        head_dim,
        GROUP=group,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # float32 models get float32 products (tf32 would break parity with the torch path).
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
