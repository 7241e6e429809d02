"""Moving KV between the paged cache and contiguous pieces: gather, digest, scatter, and the
cache views that direct pieces are sent from and received into.

A piece (`PieceSpec`) is on the wire the contiguous ``[layers, kvs, blocks, block_elements]``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.piece_plan import PieceSpec

# Digest and scatter walk a piece in chunks this size so the scatter reads what the hash just
# pulled into cache (one DRAM pass instead of two on the receiver).
CHUNK_BYTES = 1 << 20
_PIECE_RECORD = struct.Struct("<9Q")


def piece_view(buffer: torch.Tensor, spec: PieceSpec, layout: KVLayout) -> torch.Tensor:
    """The typed ``[layers, kvs, blocks, block_elements]`` view of a uint8 staging buffer."""
    nbytes = spec.nbytes(layout)
    flat = buffer[:nbytes].view(layout.torch_dtype)
    return flat.view(spec.num_layers, spec.num_kv, spec.num_blocks, layout.block_elements)


def row_span(rows: np.ndarray, spec: PieceSpec, first_block: int) -> np.ndarray:
    """A single-row piece's bytes in a host cache itself (``rows`` from `cache_rows`): blocks
    ``first_block ..`` of one layer's K or V, which are contiguous. A view, no copy: what
    direct pieces are sent from and received into."""
    if not spec.is_single_row:
        raise ValueError(f"piece {spec.index} spans several layers or both K and V")
    if not 0 <= first_block <= rows.shape[2] - spec.num_blocks:
        raise IndexError(f"blocks {first_block}..{first_block + spec.num_blocks - 1} outside "
                         f"the cache's {rows.shape[2]}")
    span = rows[spec.layer_start, spec.kv_start, first_block:first_block + spec.num_blocks]
    return span.reshape(-1)  # contiguous rows: reshape is a view


def layer_rows(cache: torch.Tensor, layer: int, layout: KVLayout) -> torch.Tensor:
    """Cache layer ``layer`` as ``[2, num_cache_blocks, block_elements]`` (a view, no copy)."""
    return cache[layer].view(2, cache.shape[2], layout.block_elements)


def gather_piece(
    cache: torch.Tensor, block_ids: torch.Tensor, spec: PieceSpec, layout: KVLayout,
    out: torch.Tensor, layers: Sequence[int] | None = None, hasher: Any = None,
) -> None:
    """Copy the piece's blocks (all its layers, or just ``layers``) into ``out`` (piece_view).

    On CUDA the copies are queued on the current stream, after the layer's writes. Host
    memory goes through `gather_rows` (see there).
    """
    ids = block_ids[spec.block_start : spec.block_end]
    chosen = layers if layers is not None else range(spec.layer_start, spec.layer_end)
    kvs = slice(spec.kv_start, spec.kv_end)
    if cache.is_cuda:
        for layer in chosen:
            target = out[layer - spec.layer_start]
            torch.index_select(layer_rows(cache, layer, layout)[kvs], 1, ids, out=target)
        return
    src, dst = cache_rows(cache, layout), byte_rows(out)
    ids_np = checked_ids(ids.numpy(), src.shape[2])
    for layer in chosen:
        gather_rows(src[layer, kvs], ids_np, dst[layer - spec.layer_start], hasher)


def cache_rows(cache: torch.Tensor, layout: KVLayout) -> np.ndarray:
    """A host cache as a uint8 numpy array ``[layers, 2, blocks, block_bytes / 2]`` (no copy)."""
    return byte_rows(cache.view(cache.shape[0], 2, cache.shape[2], layout.block_elements))


def checked_ids(ids: np.ndarray, num_cache_blocks: int) -> np.ndarray:
    """``ids`` as int64, refusing any outside ``[0, num_cache_blocks)`` (`gather_rows` clips)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_cache_blocks):
        raise IndexError(f"source block ids must lie in [0, {num_cache_blocks}), got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return ids


def gather_rows(src: np.ndarray, ids: np.ndarray, out: np.ndarray, hasher: Any = None) -> None:
    """One layer: ``out[kv, i] = src[kv, ids[i]]`` for each K/V row of ``src``, in 1 MiB chunks.

    ``ids`` must come from `checked_ids`: ``np.take(mode="clip")`` is the one numpy gather that
    writes straight into ``out`` (mode "raise" buffers it: a second copy, 3x slower), and it
    would clip a bad id silently. numpy copies at single-threaded memcpy speed without torch's
    intra-op threads (which spin against the engine and the transport on small machines). A
    ``hasher`` (xxh3) is fed each chunk right after it was written, while it is still in cache;
    callers gather layers in order so the stream matches the piece's byte order.
    """
    step = max(1, CHUNK_BYTES // out.shape[-1])
    for kv in range(src.shape[0]):
        rows, target = src[kv], out[kv]
        for start in range(0, len(ids), step):
            chunk = target[start : start + step]
            np.take(rows, ids[start : start + step], axis=0, out=chunk, mode="clip")
            if hasher is not None:
                hasher.update(chunk)


def digest(buffer: torch.Tensor) -> int:
    """xxh3-64 of a contiguous buffer's bytes (copied to host first when on CUDA)."""
    data = buffer.reshape(-1).view(torch.uint8)
    if data.is_cuda:
        data = data.cpu()
    return xxhash.xxh3_64_intdigest(data.numpy().data)


def digest_and_scatter(
    staged: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, spec: PieceSpec,
    layout: KVLayout,
) -> int:
    """Write a received piece (piece_view) into its blocks and return the xxh3-64 of its bytes.

    Host memory goes through numpy (a row copy at memcpy speed, single-threaded: torch's
    index_copy_ is several times slower and fights the engine for intra-op threads), hashed
    chunk by chunk right before each chunk is scattered, so both read cache-resident bytes.
    CUDA pieces are scattered on device and hashed via host.
    """
    ids = block_ids[spec.block_start : spec.block_end]
    kvs = slice(spec.kv_start, spec.kv_end)
    if staged.is_cuda:
        for offset in range(spec.num_layers):
            rows = layer_rows(cache, spec.layer_start + offset, layout)[kvs]
            rows.index_copy_(1, ids, staged[offset])
        return digest(staged)
    hasher = xxhash.xxh3_64()
    src = byte_rows(staged)
    dst = byte_rows(cache.view(cache.shape[0], 2, cache.shape[2], layout.block_elements))
    ids_np = ids.numpy()
    rows_per_chunk = max(1, CHUNK_BYTES // src.shape[-1])
    for offset in range(spec.num_layers):
        for kv in range(spec.num_kv):
            rows, target = src[offset, kv], dst[spec.layer_start + offset, spec.kv_start + kv]
            for start in range(0, spec.num_blocks, rows_per_chunk):
                chunk = rows[start : start + rows_per_chunk]
                hasher.update(chunk)
                target[ids_np[start : start + rows_per_chunk]] = chunk
    return hasher.intdigest()


def byte_rows(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor ``[..., elements]`` as a numpy uint8 array ``[..., bytes]`` (no copy)."""
    return tensor.view(torch.uint8).numpy()


def combine_digests(records: Sequence[tuple[PieceSpec, int, int]]) -> int:
    """Fence digest over every piece's (bounds, byte count, payload digest), in index order."""
    hasher = xxhash.xxh3_64()
    for spec, nbytes, piece_digest in sorted(records, key=lambda r: r[0].index):
        hasher.update(_PIECE_RECORD.pack(
            spec.index, spec.layer_start, spec.layer_end, spec.kv_start, spec.kv_end,
            spec.block_start, spec.block_end, nbytes, piece_digest,
        ))
    return hasher.intdigest()


def check_contiguous(buffer: torch.Tensor) -> None:
    """UCX sends a strided view wrongly and silently (its first bytes): refuse it loudly."""
    if not buffer.is_contiguous():
        raise ValueError(
            f"refusing to send a non-contiguous tensor (shape {tuple(buffer.shape)}, strides "
            f"{buffer.stride()}): UCX would transmit the wrong bytes without an error"
        )
