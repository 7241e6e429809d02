"""Piece planning: run detection, common segments, direct plans that cover every (layer, K/V,
block) exactly once, the direct-or-staged choice; and direct rows read in place (no UCX)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.kvcopy import (
    cache_rows,
    digest_and_scatter,
    gather_piece,
    piece_view,
    row_span,
)
from pdserve.handoff.piece_plan import (
    PieceSpec,
    choose_plan,
    common_segments,
    is_run,
    plan_direct_pieces,
    row_nbytes,
    run_lengths,
)

LAYOUT = KVLayout("fp", "float16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def test_run_lengths_and_common_segments() -> None:
    assert run_lengths([4, 5, 6, 9, 3, 4]) == [3, 1, 2]
    assert run_lengths([]) == [] and is_run([7, 8, 9]) and not is_run([7, 9])
    assert common_segments([3, 2, 4], [2, 5, 2]) == [2, 1, 2, 2, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(1, 64))
def test_direct_plan_covers_every_row_once_within_the_piece_bound(
        segments: list[int], max_rows: int) -> None:
    max_piece = max_rows * row_nbytes(LAYOUT)
    plan = plan_direct_pieces(LAYOUT, segments, max_piece)
    seen = np.zeros((LAYOUT.num_local_layers, 2, sum(segments)), dtype=int)
    for position, spec in enumerate(plan):
        assert spec.index == position and spec.is_single_row
        assert spec.nbytes(LAYOUT) <= max_piece
        seen[spec.layer_start, spec.kv_start, spec.block_start:spec.block_end] += 1
    assert (seen == 1).all()
    # No piece crosses a segment boundary (where one side's blocks stop being consecutive).
    cuts = np.cumsum(segments)[:-1]
    assert not any(s.block_start < c < s.block_end for s in plan for c in cuts)
    layers = [s.layer_start for s in plan]
    assert layers == sorted(layers)  # layer by layer: pieces leave as layers finish


def test_choose_plan_goes_direct_only_when_runs_are_long_enough() -> None:
    ids = list(range(10, 18))  # one run of 8 on the sender
    kwargs = {"min_piece_bytes": 1, "max_piece_bytes": 1 << 20}
    row = row_nbytes(LAYOUT)
    direct = choose_plan(LAYOUT, ids, [8], direct_min_bytes=8 * row, **kwargs)
    assert all(s.is_single_row for s in direct) and len(direct) == 3 * 2
    staged = choose_plan(LAYOUT, ids, [8], direct_min_bytes=8 * row + 1, **kwargs)
    assert all(s.num_kv == 2 for s in staged)
    assert all(s.num_kv == 2 for s in choose_plan(LAYOUT, ids, [], direct_min_bytes=1, **kwargs))
    forced = choose_plan(LAYOUT, ids, [8], direct_min_bytes=1, layers_per_piece=2, **kwargs)
    assert [s.num_layers for s in forced] == [2, 1]


def test_row_span_is_the_cache_itself_and_refuses_what_is_not_one_row() -> None:
    cache = torch.randn(LAYOUT.cache_shape(6)).to(torch.float16)
    rows = cache_rows(cache, LAYOUT)
    spec = PieceSpec(0, 1, 2, 0, 3, kv_start=1, kv_end=2)
    span = row_span(rows, spec, first_block=2)
    assert span.ctypes.data == cache[1, 1, 2].data_ptr() and span.flags.c_contiguous  # no copy
    expected = cache[1, 1, 2:5].contiguous().view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(span, expected) and span.nbytes == spec.nbytes(LAYOUT)
    with pytest.raises(IndexError):
        row_span(rows, spec, first_block=4)
    with pytest.raises(ValueError, match="several layers"):
        row_span(rows, PieceSpec(0, 0, 2, 0, 3, 1, 2), first_block=0)


def test_a_single_kv_piece_gathers_and_scatters_only_its_half() -> None:
    src = torch.randn(LAYOUT.cache_shape(8)).to(torch.float16)
    dst = torch.zeros_like(src)
    spec = PieceSpec(0, 0, 2, 0, 3, kv_start=1, kv_end=2)  # V of layers 0-1, three blocks
    src_ids, dst_ids = torch.tensor([5, 1, 6]), torch.tensor([0, 7, 3])
    buffer = torch.empty(spec.nbytes(LAYOUT), dtype=torch.uint8)
    gather_piece(src, src_ids, spec, LAYOUT, piece_view(buffer, spec, LAYOUT))
    digest_and_scatter(piece_view(buffer, spec, LAYOUT), dst, dst_ids, spec, LAYOUT)
    assert torch.equal(dst[:2, 1][:, dst_ids], src[:2, 1][:, src_ids])
    assert not dst[:, 0].any() and not dst[2].any()  # K and the third layer untouched
