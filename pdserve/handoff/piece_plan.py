"""How a transfer is cut into pieces: staged rectangles of (layers x K/V x blocks), or direct
pieces of one layer's K or V over blocks that are consecutive on both sides (sent from and
received into the caches themselves, no copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.kv_layout import KVLayout

# A ticket lists the receiver's block runs only up to this many; beyond it the blocks are too
# scattered for direct pieces to pay, and the ticket says so with an empty list.
MAX_TICKET_RUNS = 256
# Pieces a same-host receiver reads itself, announced by PIECE frames (no read slot free),
# group layers up to this size: a frame costs ~0.2-0.3 ms on 2 busy cores, while smaller
# pieces start the reads sooner. Measured (32-layer fp16 KV, medians of 3, one copy thread):
# 16 MiB transfers 18 ms with one layer per piece, 11 ms at 4 MiB, 14 ms at 8 MiB; 64 MiB 37 /
# 28 / 28 ms.
READ_MIN_PIECE_BYTES = 4 << 20
# Read pieces announced through shared slots cost tens of microseconds each, not a frame:
# smaller ones let the receiver's copies start sooner and overlap the sender's hashing
# (measured 0.5-4 MiB: within noise of each other at 16-256 MiB; 1 MiB kept).
SLOT_MIN_PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class PieceSpec:
    """Layers ``[layer_start, layer_end)`` (local cache indices) x K/V ``[kv_start, kv_end)``
    (0 = K, 1 = V) x the request's blocks ``[block_start, block_end)`` (positions in its
    block list, not block ids). On the wire: ``[layers, kvs, blocks, block_elements]``."""

    index: int
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    kv_start: int = 0
    kv_end: int = 2

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start

    @property
    def num_blocks(self) -> int:
        return self.block_end - self.block_start

    @property
    def is_single_row(self) -> bool:
        """One layer's K or V: contiguous in a cache wherever its blocks are consecutive."""
        return self.num_layers == 1 and self.num_kv == 1

    def nbytes(self, layout: KVLayout) -> int:
        return self.num_layers * self.num_kv * self.num_blocks * row_nbytes(layout)


def row_nbytes(layout: KVLayout) -> int:
    """Bytes of one block's K (or V) in one layer."""
    return layout.block_elements * layout.torch_dtype.itemsize


def run_lengths(block_ids: Sequence[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive ascending ids, in order."""
    runs: list[int] = []
    for position, block in enumerate(block_ids):
        if position and block == block_ids[position - 1] + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def is_run(block_ids: Sequence[int]) -> bool:
    return all(b == block_ids[0] + i for i, b in enumerate(block_ids))


def common_segments(*run_lists: Sequence[int]) -> list[int]:
    """Split points where every side's blocks are consecutive (typically the sender's and the
    receiver's runs): the lengths of the segments between every run boundary of any side."""
    cuts = set()
    for runs in run_lists:
        position = 0
        for length in runs:
            position += length
            cuts.add(position)
    segments, previous = [], 0
    for cut in sorted(cuts):
        segments.append(cut - previous)
        previous = cut
    return segments


def plan_pieces(
    layout: KVLayout,
    num_blocks: int,
    min_piece_bytes: int,
    max_piece_bytes: int,
    layers_per_piece: int | None = None,
) -> list[PieceSpec]:
    """Staged plan: layers x both K/V x all blocks, at most ``max_piece_bytes`` each.

    Small layers are grouped (``layers_per_piece``, or enough layers to reach
    ``min_piece_bytes``) so per-message overhead stays small; a layer larger than
    ``max_piece_bytes`` is split by blocks.
    """
    num_layers = layout.num_local_layers
    layer_bytes = num_blocks * layout.block_bytes
    if layout.block_bytes > max_piece_bytes:
        raise ValueError(
            f"one KV block ({layout.block_bytes} bytes) exceeds the receiver's piece bound "
            f"({max_piece_bytes} bytes)"
        )
    pieces: list[PieceSpec] = []
    if layer_bytes > max_piece_bytes:
        step = max_piece_bytes // layout.block_bytes
        for layer in range(num_layers):
            for start in range(0, num_blocks, step):
                end = min(num_blocks, start + step)
                pieces.append(PieceSpec(len(pieces), layer, layer + 1, start, end))
        return pieces
    if layers_per_piece is None:
        layers_per_piece = math.ceil(min_piece_bytes / layer_bytes)
    group = max(1, min(layers_per_piece, max_piece_bytes // layer_bytes, num_layers))
    for start in range(0, num_layers, group):
        end = min(num_layers, start + group)
        pieces.append(PieceSpec(len(pieces), start, end, 0, num_blocks))
    return pieces


def plan_direct_pieces(layout: KVLayout, segments: Sequence[int],
                       max_piece_bytes: int) -> list[PieceSpec]:
    """Direct plan: per layer, K then V, one piece per segment (split at ``max_piece_bytes``).

    Pieces go layer by layer so a layer's pieces can leave as soon as the engine wrote it.
    """
    step = max(1, max_piece_bytes // row_nbytes(layout))
    bounds: list[tuple[int, int]] = []
    start = 0
    for length in segments:
        for offset in range(0, length, step):
            bounds.append((start + offset, start + min(length, offset + step)))
        start += length
    return [
        PieceSpec(layer * 2 * len(bounds) + kv * len(bounds) + i, layer, layer + 1, lo, hi,
                  kv, kv + 1)
        for layer in range(layout.num_local_layers)
        for kv in (0, 1)
        for i, (lo, hi) in enumerate(bounds)
    ]


def choose_plan(layout: KVLayout, sender_ids: Sequence[int], receiver_runs: Sequence[int],
                *, min_piece_bytes: int, max_piece_bytes: int, direct_min_bytes: int,
                layers_per_piece: int | None = None) -> list[PieceSpec]:
    """Direct pieces when both sides' blocks run long enough that a piece averages at least
    ``direct_min_bytes`` (each piece costs a message; a staged byte costs two copies);
    otherwise the staged plan. An empty ``receiver_runs`` means "too scattered": staged."""
    if receiver_runs and layers_per_piece is None:
        segments = common_segments(run_lengths(sender_ids), receiver_runs)
        average = len(sender_ids) * row_nbytes(layout) / len(segments)
        if average >= direct_min_bytes and row_nbytes(layout) <= max_piece_bytes:
            return plan_direct_pieces(layout, segments, max_piece_bytes)
    return plan_pieces(layout, len(sender_ids), min_piece_bytes, max_piece_bytes,
                       layers_per_piece)
