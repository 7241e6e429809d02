"""Piece planning: grouping small layers, splitting large ones, covering every (layer, K/V,
block) exactly once within the receiver's piece bound (no UCX)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.plan import plan_pieces

LAYOUT = KVLayout("fp", "bfloat16", block_size=4, num_layers=5, num_kv_heads=2, head_dim=8)
KV = KVSlice.whole(LAYOUT)


def test_plan_groups_small_layers_and_splits_large_ones() -> None:
    layer_bytes = 6 * LAYOUT.block_bytes
    grouped = plan_pieces(KV, 6, min_piece_bytes=2 * layer_bytes, max_piece_bytes=1 << 20)
    assert [(p.layer_start, p.layer_end) for p in grouped] == [(0, 2), (2, 4), (4, 5)]
    split = plan_pieces(KV, 6, 1, max_piece_bytes=4 * LAYOUT.block_bytes)
    bounds = [(p.layer_start, p.block_start, p.block_end) for p in split[:2]]
    assert bounds == [(0, 0, 4), (0, 4, 6)]
    assert len(split) == 10 and [p.index for p in split] == list(range(10))
    with pytest.raises(ValueError, match="exceeds"):
        plan_pieces(KV, 6, 1, LAYOUT.block_bytes - 1)
    capped = plan_pieces(KV, 6, min_piece_bytes=1 << 30, max_piece_bytes=2 * layer_bytes)
    assert [(p.layer_start, p.layer_end) for p in capped] == [(0, 2), (2, 4), (4, 5)]


@settings(max_examples=80, deadline=None)
@given(num_blocks=st.integers(1, 40), num_layers=st.integers(1, 8),
       max_piece_blocks=st.integers(1, 64), min_piece_blocks=st.integers(1, 64),
       group=st.one_of(st.none(), st.integers(1, 9)))
def test_every_plan_covers_each_slot_once_within_the_bound(
        num_blocks: int, num_layers: int, max_piece_blocks: int, min_piece_blocks: int,
        group: int | None) -> None:
    layout = replace(LAYOUT, num_layers=num_layers, layer_end=num_layers)
    max_piece = max_piece_blocks * layout.block_bytes
    plan = plan_pieces(KVSlice.whole(layout), num_blocks, min_piece_blocks * layout.block_bytes,
                       max_piece, group)
    seen = np.zeros((num_layers, 2, num_blocks), dtype=int)
    for index, spec in enumerate(plan):
        assert spec.index == index and spec.nbytes(KVSlice.whole(layout)) <= max_piece
        seen[spec.layer_start:spec.layer_end, spec.kv_start:spec.kv_end,
             spec.block_start:spec.block_end] += 1
    assert (seen == 1).all()
    # Pieces follow the engine's layer order, so each can leave once its last layer is written.
    assert [s.layer_end for s in plan] == sorted(s.layer_end for s in plan)
