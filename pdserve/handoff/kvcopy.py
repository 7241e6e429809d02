"""Moving KV between the paged cache and contiguous pieces (``[layers, kvs, blocks,
block_elements]`` on the wire): gather into staging on the sender, scatter out of staging on
the receiver, each hashing the bytes it moves. Host memory goes through numpy (row copies at
memcpy speed on one thread: torch's index_select/index_copy_ cost 1.5-2x and spin intra-op
threads against the engine); CUDA memory through torch on the current stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.digest import device_digest
from pdserve.handoff.plan import PieceSpec

# Gather and scatter walk a piece in chunks this size and hash each chunk right after (or
# before) copying it, while it is still in cache: one DRAM pass for copy and hash together.
CHUNK_BYTES = 1 << 20


def piece_view(buffer: torch.Tensor, spec: PieceSpec, layout: KVLayout) -> torch.Tensor:
    """The typed ``[layers, kvs, blocks, block_elements]`` view of a uint8 staging buffer."""
    flat = buffer[:spec.nbytes(layout)].view(layout.torch_dtype)
    return flat.view(spec.num_layers, spec.num_kv, spec.num_blocks, layout.block_elements)


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


def gather_rows(src: np.ndarray, ids: np.ndarray, out: np.ndarray, hasher: Any = None) -> None:
    """One layer of a host piece: ``out[kv, i] = src[kv, ids[i]]`` for each K/V row of ``src``.

    ``ids`` must come from `checked_ids`: ``np.take(mode="clip")`` is the one numpy gather that
    writes straight into ``out`` (mode "raise" buffers it: a second copy), and it would clip a
    bad id silently. ``hasher`` (xxh3) is fed each chunk right after it was written; callers
    gather layers in order so the stream matches the piece's byte order.
    """
    step = max(1, CHUNK_BYTES // out.shape[-1])
    for kv in range(src.shape[0]):
        rows, target = src[kv], out[kv]
        for start in range(0, len(ids), step):
            chunk = target[start:start + step]
            np.take(rows, ids[start:start + step], axis=0, out=chunk, mode="clip")
            if hasher is not None:
                hasher.update(chunk)


def gather_cuda_layer(cache: torch.Tensor, ids: torch.Tensor, spec: PieceSpec, layer: int,
                      layout: KVLayout, out: torch.Tensor) -> None:
    """One layer of a CUDA piece into ``out`` (its `piece_view`), queued on the current stream
    after the layer's own writes."""
    source = layer_rows(cache, layer, layout)[spec.kv_start:spec.kv_end]
    torch.index_select(source, 1, ids[spec.block_start:spec.block_end],
                       out=out[layer - spec.layer_start])


def scatter_piece(staged: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                  spec: PieceSpec, layout: KVLayout) -> int:
    """Write a received piece (its `piece_view`) into its blocks; return the digest of its
    bytes. Host: each chunk hashed right before it is scattered. CUDA: scattered and hashed on
    the device; the digest's host read waits for both (the blocks are written on return)."""
    ids = block_ids[spec.block_start:spec.block_end]
    kvs = slice(spec.kv_start, spec.kv_end)
    if staged.is_cuda:
        for offset in range(spec.num_layers):
            layer_rows(cache, spec.layer_start + offset, layout)[kvs].index_copy_(
                1, ids, staged[offset])
        return device_digest(staged)
    hasher = xxhash.xxh3_64()
    src, dst = byte_rows(staged), cache_rows(cache, layout)
    ids_np = ids.numpy()
    step = max(1, CHUNK_BYTES // src.shape[-1])
    for offset in range(spec.num_layers):
        for kv in range(spec.num_kv):
            rows, target = src[offset, kv], dst[spec.layer_start + offset, spec.kv_start + kv]
            for start in range(0, spec.num_blocks, step):
                chunk = rows[start:start + step]
                hasher.update(chunk)
                target[ids_np[start:start + step]] = chunk
    return hasher.intdigest()


def check_contiguous(buffer: torch.Tensor) -> None:
    """UCX sends a strided view wrongly and silently (its first bytes): refuse it loudly."""
    if not buffer.is_contiguous():
        raise ValueError(
            f"refusing to send a non-contiguous tensor (shape {tuple(buffer.shape)}, strides "
            f"{buffer.stride()}): UCX would transmit the wrong bytes without an error")
