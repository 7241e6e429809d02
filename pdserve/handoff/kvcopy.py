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
from pdserve.handoff.piece_plan import PieceSpec, common_segments, run_lengths

# Digest and scatter walk a piece in chunks this size so the scatter reads what the hash just
# pulled into cache (one DRAM pass instead of two on the receiver).
CHUNK_BYTES = 1 << 20
# Reads of a peer's cache copy and hash this much at a time: the hash then runs on bytes still
# in L2 (measured on 2 cores: 6.3 GB/s copy+hash at 256 KiB, 5.4 at 1 MiB, 4.1 at 4 MiB).
# Also the least a digest hashes per call where it can (python-xxhash keeps the GIL below
# ~64 KiB; see `digest_rows`).
READ_CHUNK_BYTES = 256 << 10
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


def joint_runs(*ids: Sequence[int]) -> list[tuple[int, int]]:
    """(position, length) of the stretches where every id list counts up by one together."""
    if not len(ids[0]):
        return []
    lengths = common_segments(*(run_lengths(np.asarray(i).tolist()) for i in ids))
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    return list(zip(starts, lengths, strict=True))


def clip_runs(runs: Sequence[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The part of `joint_runs` over a whole id list that lies in positions ``[start, end)``:
    a transfer finds its runs once, each piece clips them to its blocks."""
    clipped = []
    for position, length in runs:
        low, high = max(position, start), min(position + length, end)
        if low < high:
            clipped.append((low, high - low))
    return clipped


def digest_rows(rows: np.ndarray, ids: np.ndarray, spec: PieceSpec,
                runs: Sequence[tuple[int, int]] | None = None) -> int:
    """xxh3-64 of a piece's bytes where they sit in a host cache (``rows`` from `cache_rows`,
    ``ids`` the request's block ids): what a sender announces for a piece the receiver reads
    itself. Runs of at least `READ_CHUNK_BYTES` are hashed in place (``runs``: `joint_runs`
    of ``ids``, if already known); shorter ones are gathered into chunks of that size first,
    because python-xxhash keeps the GIL while it hashes under ~64 KiB: a loop of 16 KiB
    updates on the compute thread held the transport's loop thread off for whole 5 ms switch
    intervals (a 256 MiB transfer's BEGIN went out 47 ms late)."""
    hasher = xxhash.xxh3_64()
    runs = joint_runs(ids) if runs is None else runs
    spans = [(int(ids[p]), n) for p, n in clip_runs(runs, spec.block_start, spec.block_end)]
    step = max(1, READ_CHUNK_BYTES // rows.shape[-1])
    if all(length >= step for _, length in spans):
        for layer in range(spec.layer_start, spec.layer_end):
            for kv in range(spec.kv_start, spec.kv_end):
                plane = rows[layer, kv]
                for first, length in spans:
                    hasher.update(plane[first:first + length])
        return hasher.intdigest()
    order = piece_row_order(spec, ids, rows.shape[2])
    flat = flat_rows(rows)
    scratch = np.empty((min(step, len(order)), rows.shape[-1]), dtype=np.uint8)
    for start in range(0, len(order), step):
        chunk = scratch[:min(step, len(order) - start)]
        np.take(flat, order[start:start + step], axis=0, out=chunk, mode="clip")
        hasher.update(chunk)
    return hasher.intdigest()


def piece_row_order(spec: PieceSpec, ids: np.ndarray, num_cache_blocks: int) -> np.ndarray:
    """The piece's rows in wire order (layer, K/V, block), as indices into `flat_rows` of a
    cache with ``num_cache_blocks`` blocks (``ids``: the request's checked block ids)."""
    planes = (np.arange(spec.layer_start, spec.layer_end)[:, None] * 2
              + np.arange(spec.kv_start, spec.kv_end)[None, :]).reshape(-1, 1)
    return (planes * num_cache_blocks
            + np.asarray(ids[spec.block_start:spec.block_end], dtype=np.int64)).reshape(-1)


def flat_rows(rows: np.ndarray) -> np.ndarray:
    """`cache_rows` as ``[layers * 2 * blocks, row bytes]``: a view (refused if it would copy)."""
    if not rows.flags.c_contiguous:
        raise ValueError("cache rows are not contiguous: a flat view would be a copy")
    return rows.reshape(-1, rows.shape[-1])


def read_piece(src: np.ndarray, src_ids: np.ndarray, dst: np.ndarray, dst_ids: np.ndarray,
               spec: PieceSpec, runs: Sequence[tuple[int, int]] | None = None,
               corrupt: bool = False) -> int:
    """Copy a piece from a peer's cache rows ``src`` into ours ``dst`` (both from
    `cache_rows`; ids already range-checked) and return the xxh3-64 of the bytes that landed.

    Each `READ_CHUNK_BYTES` is hashed right after it was copied, while in cache: one DRAM read
    and one write per byte. Where both sides' blocks run together the copy goes straight
    between the caches; scattered blocks go through a cache-sized scratch (gather, hash,
    scatter. ``runs``: `joint_runs` of both id lists, if already known. ``corrupt`` (tests)
    flips a landed byte before hashing: a bad read.
    """
    s_ids = src_ids[spec.block_start:spec.block_end]
    d_ids = dst_ids[spec.block_start:spec.block_end]
    step = max(1, READ_CHUNK_BYTES // dst.shape[-1])
    runs = joint_runs(src_ids, dst_ids) if runs is None else runs
    segments = [(p - spec.block_start, n)
                for p, n in clip_runs(runs, spec.block_start, spec.block_end)]
    hasher = xxhash.xxh3_64()
    scratch = None if 4 * len(s_ids) >= step * len(segments) else \
        np.empty((step, dst.shape[-1]), dtype=np.uint8)
    for layer in range(spec.layer_start, spec.layer_end):
        for kv in range(spec.kv_start, spec.kv_end):
            s_plane, d_plane = src[layer, kv], dst[layer, kv]
            if scratch is None:
                for position, length in segments:
                    first_src, first_dst = int(s_ids[position]), int(d_ids[position])
                    for offset in range(0, length, step):
                        size = min(step, length - offset)
                        out = d_plane[first_dst + offset:first_dst + offset + size]
                        np.copyto(out, s_plane[first_src + offset:first_src + offset + size])
                        corrupt = _flip_once(out, corrupt)
                        hasher.update(out)
                continue
            for start in range(0, len(s_ids), step):
                chunk = scratch[:min(step, len(s_ids) - start)]
                np.take(s_plane, s_ids[start:start + step], axis=0, out=chunk, mode="clip")
                corrupt = _flip_once(chunk, corrupt)
                hasher.update(chunk)
                d_plane[d_ids[start:start + step]] = chunk
    return hasher.intdigest()


def _flip_once(rows: np.ndarray, corrupt: bool) -> bool:
    if corrupt:
        rows[0, 0] ^= 0xFF
    return False


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
