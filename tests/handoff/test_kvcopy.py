"""Piece plans, gather/scatter between paged caches and pieces, digests, contiguity (no UCX)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
import xxhash

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.kvcopy import (
    check_contiguous,
    combine_digests,
    digest,
    digest_and_scatter,
    gather_piece,
    piece_view,
)
from pdserve.handoff.piece_plan import PieceSpec, plan_pieces
from pdserve.handoff.transport import _ucx_buffer

LAYOUT = KVLayout("fp", "bfloat16", block_size=4, num_layers=5, num_kv_heads=2, head_dim=8)


def test_plan_groups_small_layers_and_splits_large_ones() -> None:
    layer_bytes = 6 * LAYOUT.block_bytes
    grouped = plan_pieces(LAYOUT, 6, min_piece_bytes=2 * layer_bytes, max_piece_bytes=1 << 20)
    assert [(p.layer_start, p.layer_end) for p in grouped] == [(0, 2), (2, 4), (4, 5)]
    split = plan_pieces(LAYOUT, 6, 1, max_piece_bytes=4 * LAYOUT.block_bytes)
    bounds = [(p.layer_start, p.block_start, p.block_end) for p in split[:2]]
    assert bounds == [(0, 0, 4), (0, 4, 6)]
    assert len(split) == 10 and [p.index for p in split] == list(range(10))
    with pytest.raises(ValueError, match="exceeds"):
        plan_pieces(LAYOUT, 6, 1, LAYOUT.block_bytes - 1)
    capped = plan_pieces(LAYOUT, 6, min_piece_bytes=1 << 30, max_piece_bytes=2 * layer_bytes)
    assert [(p.layer_start, p.layer_end) for p in capped] == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [8, 512])  # tiny rows (vectorised) and 4 KiB+ rows (loop)
def test_gather_then_scatter_moves_exact_bytes_between_unordered_blocks(dtype: str,
                                                                        head_dim: int) -> None:
    layout = replace(LAYOUT, dtype=dtype, head_dim=head_dim)
    rng = random.Random(dtype)
    src_cache = torch.randn(layout.cache_shape(20)).to(layout.torch_dtype)
    dst_cache = torch.zeros(layout.cache_shape(16), dtype=layout.torch_dtype)
    src_ids = torch.tensor(rng.sample(range(20), 7))
    dst_ids = torch.tensor(rng.sample(range(16), 7))
    for spec in plan_pieces(layout, 7, 1, 3 * layout.block_bytes * 2, layers_per_piece=2):
        buffer = torch.empty(spec.nbytes(layout), dtype=torch.uint8)
        staged = piece_view(buffer, spec, layout)
        gather_piece(src_cache, src_ids, spec, layout, staged)
        assert digest_and_scatter(staged, dst_cache, dst_ids, spec, layout) == digest(buffer)
    assert torch.equal(dst_cache[:, :, dst_ids].view(torch.uint8),
                       src_cache[:, :, src_ids].view(torch.uint8))
    untouched = sorted(set(range(16)) - set(dst_ids.tolist()))
    assert not dst_cache[:, :, untouched].view(torch.uint8).any()


def test_layer_by_layer_gather_equals_whole_piece_gather() -> None:
    cache = torch.randn(LAYOUT.cache_shape(9)).to(LAYOUT.torch_dtype)
    ids = torch.tensor([8, 1, 5])
    spec = PieceSpec(0, 1, 4, 0, 3)
    whole, parts = (torch.empty(spec.nbytes(LAYOUT), dtype=torch.uint8) for _ in range(2))
    gather_piece(cache, ids, spec, LAYOUT, piece_view(whole, spec, LAYOUT))
    for layer in (3, 1, 2):
        gather_piece(cache, ids, spec, LAYOUT, piece_view(parts, spec, LAYOUT), layers=[layer])
    assert torch.equal(whole, parts)


@pytest.mark.parametrize("bad", [-1, 9])
def test_gather_refuses_source_ids_outside_the_cache(bad: int) -> None:
    # the gather clips ids for speed, so a bad id must be refused before it copies anything
    cache = torch.randn(LAYOUT.cache_shape(9)).to(LAYOUT.torch_dtype)
    spec = PieceSpec(0, 0, 1, 0, 2)
    buffer = torch.zeros(spec.nbytes(LAYOUT), dtype=torch.uint8)
    with pytest.raises(IndexError, match=r"\[0, 9\)"):
        gather_piece(cache, torch.tensor([3, bad]), spec, LAYOUT, piece_view(buffer, spec, LAYOUT))
    assert not buffer.any()


def test_digest_is_xxh3_of_the_bytes_and_the_fence_digest_depends_on_every_field() -> None:
    data = torch.arange(1000, dtype=torch.int16)
    assert digest(data) == xxhash.xxh3_64_intdigest(data.numpy().tobytes())
    spec = PieceSpec(0, 0, 1, 0, 2)
    base = combine_digests([(spec, 10, 99)])
    assert combine_digests([(spec, 10, 98)]) != base
    assert combine_digests([(spec, 11, 99)]) != base
    assert combine_digests([(replace(spec, block_end=3), 10, 99)]) != base
    two = [(spec, 10, 99), (PieceSpec(1, 1, 2, 0, 2), 10, 7)]
    assert combine_digests(two) == combine_digests(two[::-1])  # index order, not arrival order


def test_non_contiguous_buffers_are_never_handed_to_ucx() -> None:
    strided = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="non-contiguous"):
        check_contiguous(strided)
    with pytest.raises(ValueError, match="non-contiguous"):
        _ucx_buffer(strided)
    with pytest.raises(ValueError, match="non-contiguous"):
        _ucx_buffer(np.zeros((4, 6))[:, ::2])
    contiguous = torch.arange(12, dtype=torch.float32)
    view = _ucx_buffer(contiguous)
    assert view.nbytes == 48 and np.shares_memory(view, contiguous.numpy())
