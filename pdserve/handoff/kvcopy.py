"""Moving KV between the paged cache and contiguous pieces (``[layers, kvs, blocks,
block_elements]`` on the wire): gather into staging on the sender, scatter out of staging on
the receiver, each hashing the bytes it moves. Host memory goes through numpy (row copies at
memcpy speed on one thread: torch's index_select/index_copy_ cost 1.5-2x and spin intra-op
threads against the engine); CUDA memory through torch on the current stream.

A transfer of some of a cache's KV heads (`KVSlice`, between TP ranks) copies each block's
elements of those heads, strided views over the blocks in the layout's memory order; one of
all the heads copies whole blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.digest import device_digest
from pdserve.handoff.plan import PieceSpec

# Gather and scatter walk a piece in chunks this size and hash each chunk right after (or
# before) copying it, while it is still in cache: one DRAM pass for copy and hash together.
CHUNK_BYTES = 1 << 20


def piece_view(buffer: torch.Tensor, spec: PieceSpec, kv: KVSlice) -> torch.Tensor:
    """The typed ``[layers, kvs, blocks, block_elements]`` view of a uint8 staging buffer."""
    flat = buffer[:spec.nbytes(kv)].view(kv.torch_dtype)
    return flat.view(spec.num_layers, spec.num_kv, spec.num_blocks, kv.block_elements)


def head_rows(rows: np.ndarray, kv: KVSlice) -> np.ndarray:
    """Whole blocks' bytes ``[..., blocks, row bytes]`` as ``[..., blocks, *dims]`` (the last
    dim in bytes) narrowed to ``kv``'s heads: a strided view. All heads: ``rows`` itself."""
    if kv.is_whole:
        return rows
    dims = [*kv.layout.block_dims[:-1], kv.layout.block_dims[-1] * kv.element_size]
    shaped = rows.reshape(*rows.shape[:-1], *dims)
    axis = rows.ndim - 1 + kv.layout.head_axis
    index = [slice(None)] * shaped.ndim
    index[axis] = slice(kv.head_offset, kv.head_offset + kv.num_heads)
    return shaped[tuple(index)]


def piece_rows(rows: np.ndarray, kv: KVSlice) -> np.ndarray:
    """A piece's bytes ``[..., blocks, slice row bytes]`` shaped as `head_rows` of the same
    heads (a view of contiguous memory)."""
    if kv.is_whole:
        return rows
    dims = [*kv.block_dims[:-1], kv.block_dims[-1] * kv.element_size]
    return rows.reshape(*rows.shape[:-1], *dims)


def head_tensor(cache: torch.Tensor, layer: int, kv: KVSlice) -> torch.Tensor:
    """CUDA gathers and scatters: cache layer ``layer`` as ``[2, blocks, *kv.block_dims]``
    narrowed to ``kv``'s heads (a view, no copy)."""
    shaped = cache[layer].view(2, cache.shape[2], *kv.layout.block_dims)
    return shaped.narrow(2 + kv.layout.head_axis, kv.head_offset, kv.num_heads)


def layer_rows(cache: torch.Tensor, layer: int, layout: KVLayout) -> torch.Tensor:
    """Cache layer ``layer`` as ``[2, num_cache_blocks, block_elements]`` (a view, no copy)."""
    return cache[layer].view(2, cache.shape[2], layout.block_elements)


def byte_rows(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor ``[..., elements]`` as a numpy uint8 array ``[..., bytes]`` (no copy)."""
    return tensor.view(torch.uint8).numpy()


def cache_rows(cache: torch.Tensor, layout: KVLayout) -> np.ndarray:
    """A host cache as a uint8 numpy array ``[layers, 2, blocks, row bytes]`` (no copy)."""
    return byte_rows(cache.view(cache.shape[0], 2, cache.shape[2], layout.block_elements))


def checked_ids(ids: np.ndarray, num_cache_blocks: int) -> np.ndarray:
    """``ids`` as int64, refusing any outside ``[0, num_cache_blocks)`` (`gather_rows` clips)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_cache_blocks):
        raise IndexError(f"block ids must lie in [0, {num_cache_blocks}), got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return ids


def gather_rows(src: np.ndarray, ids: np.ndarray, out: np.ndarray, kv: KVSlice,
                hasher: Any = None) -> None:
    """One layer of a host piece: ``out[k, i] = src[k, ids[i]]`` (``kv``'s heads of it) for each
    K/V row of ``src`` (``[kvs, cache blocks, row bytes]``; ``out``: ``[kvs, n, slice row
    bytes]``).

    ``ids`` must come from `checked_ids`: ``np.take(mode="clip")`` is the one numpy gather that
    writes straight into ``out`` (mode "raise" buffers it: a second copy), and it would clip a
    bad id silently. ``hasher`` (xxh3) is fed each chunk right after it was written; callers
    gather layers in order so the stream matches the piece's byte order.
    """
    step = max(1, CHUNK_BYTES // out.shape[-1])
    for k in range(src.shape[0]):
        rows, target = head_rows(src[k], kv), out[k]
        for start in range(0, len(ids), step):
            chunk = target[start:start + step]
            np.take(rows, ids[start:start + step], axis=0, out=piece_rows(chunk, kv), mode="clip")
            if hasher is not None:
                hasher.update(chunk)


def gather_cuda_layer(cache: torch.Tensor, ids: torch.Tensor, spec: PieceSpec, layer: int,
                      kv: KVSlice, out: torch.Tensor) -> None:
    """One layer of a CUDA piece into ``out`` (its `piece_view`), queued on the current stream
    after the layer's own writes."""
    target = out[layer - spec.layer_start]
    if kv.is_whole:
        source = layer_rows(cache, layer, kv.layout)[spec.kv_start:spec.kv_end]
    else:
        source = head_tensor(cache, layer, kv)[spec.kv_start:spec.kv_end]
        target = target.view(spec.num_kv, spec.num_blocks, *kv.block_dims)
    torch.index_select(source, 1, ids[spec.block_start:spec.block_end], out=target)


def scatter_piece(staged: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                  spec: PieceSpec, kv: KVSlice) -> int:
    """Write a received piece (its `piece_view`) into its blocks; return the digest of its
    bytes. Host: each chunk hashed right before it is scattered. CUDA: scattered and hashed on
    the device; the digest's host read waits for both (the blocks are written on return)."""
    ids = block_ids[spec.block_start:spec.block_end]
    kvs = slice(spec.kv_start, spec.kv_end)
    if staged.is_cuda:
        for offset in range(spec.num_layers):
            layer = spec.layer_start + offset
            if kv.is_whole:
                layer_rows(cache, layer, kv.layout)[kvs].index_copy_(1, ids, staged[offset])
            else:
                head_tensor(cache, layer, kv)[kvs].index_copy_(
                    1, ids, staged[offset].view(spec.num_kv, spec.num_blocks, *kv.block_dims))
        return device_digest(staged)
    hasher = xxhash.xxh3_64()
    src, dst = byte_rows(staged), cache_rows(cache, kv.layout)
    ids_np = ids.numpy()
    step = max(1, CHUNK_BYTES // src.shape[-1])
    for offset in range(spec.num_layers):
        for k in range(spec.num_kv):
            rows = src[offset, k]
            target = head_rows(dst[spec.layer_start + offset, spec.kv_start + k], kv)
            for start in range(0, spec.num_blocks, step):
                chunk = rows[start:start + step]
                hasher.update(chunk)
                target[ids_np[start:start + step]] = piece_rows(chunk, kv)
    return hasher.intdigest()


def check_contiguous(buffer: torch.Tensor) -> None:
    """UCX sends a strided view wrongly and silently (its first bytes): refuse it loudly."""
    if not buffer.is_contiguous():
        raise ValueError(
            f"refusing to send a non-contiguous tensor (shape {tuple(buffer.shape)}, strides "
            f"{buffer.stride()}): UCX would transmit the wrong bytes without an error")
