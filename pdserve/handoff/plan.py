"""How a transfer is cut into pieces: rectangles of (layers x K/V x a run of the request's
blocks) of the transfer's KV heads, each at most the receiver's piece bound, in the order the
engine writes layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.kv.layout import KVSlice


@dataclass(frozen=True)
class PieceSpec:
    """Layers ``[layer_start, layer_end)`` (local cache indices) x K/V ``[kv_start, kv_end)``
    (0 = K, 1 = V) x the request's blocks ``[block_start, block_end)`` (positions in its
    block list, not block ids), of the transfer's KV heads. On the wire: ``[layers, kvs, blocks,
    block_elements]`` (`KVSlice.block_elements`: each block's elements of those heads)."""

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

    def nbytes(self, kv: KVSlice) -> int:
        row = kv.block_elements * kv.element_size  # one block's K (or V)
        return self.num_layers * self.num_kv * self.num_blocks * row


def plan_pieces(layout: KVSlice, num_blocks: int, min_piece_bytes: int, max_piece_bytes: int,
                layers_per_piece: int | None = None) -> list[PieceSpec]:
    """Layers x both K/V x all blocks, at most ``max_piece_bytes`` each.

    Small layers are grouped (``layers_per_piece``, or enough layers to reach
    ``min_piece_bytes``) so per-message costs stay small; a layer larger than
    ``max_piece_bytes`` is split by blocks.
    """
    num_layers = layout.num_local_layers
    layer_bytes = num_blocks * layout.block_bytes
    if layout.block_bytes > max_piece_bytes:
        raise ValueError(f"one KV block ({layout.block_bytes} bytes) exceeds the receiver's "
                         f"piece bound ({max_piece_bytes} bytes)")
    pieces: list[PieceSpec] = []
    if layer_bytes > max_piece_bytes:
        step = max_piece_bytes // layout.block_bytes
        for layer in range(num_layers):
            for start in range(0, num_blocks, step):
                pieces.append(PieceSpec(len(pieces), layer, layer + 1, start,
                                        min(num_blocks, start + step)))
        return pieces
    if layers_per_piece is None:
        layers_per_piece = math.ceil(min_piece_bytes / layer_bytes)
    group = max(1, min(layers_per_piece, max_piece_bytes // layer_bytes, num_layers))
    for start in range(0, num_layers, group):
        pieces.append(PieceSpec(len(pieces), start, min(num_layers, start + group), 0,
                                num_blocks))
    return pieces
