"""Gather/scatter between paged caches and pieces, both digests, contiguity (no UCX)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import xxhash

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.digest import combine_digests, device_digest, digest
from pdserve.handoff.kvcopy import (
    byte_rows,
    cache_rows,
    check_contiguous,
    checked_ids,
    gather_rows,
    piece_view,
    scatter_piece,
)
from pdserve.handoff.plan import PieceSpec, plan_pieces

LAYOUT = KVLayout("fp", "bfloat16", block_size=4, num_layers=5, num_kv_heads=2, head_dim=8)


def gather(cache: torch.Tensor, ids: list[int], spec: PieceSpec, kv: KVSlice | KVLayout,
           buffer: torch.Tensor) -> int:
    """What the sender does per layer, for a whole piece; returns the digest it took."""
    kv = kv if isinstance(kv, KVSlice) else KVSlice.whole(kv)
    hasher = xxhash.xxh3_64()
    view, rows = piece_view(buffer, spec, kv), cache_rows(cache, kv.layout)
    checked = checked_ids(torch.tensor(ids).numpy(), cache.shape[2])
    for layer in range(spec.layer_start, spec.layer_end):
        gather_rows(rows[layer, spec.kv_start:spec.kv_end],
                    checked[spec.block_start:spec.block_end],
                    byte_rows(view[layer - spec.layer_start]), kv, hasher)
    return hasher.intdigest()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [8, 512])  # tiny rows and 4 KiB+ rows
def test_gather_then_scatter_moves_exact_bytes_between_unordered_blocks(dtype: str,
                                                                        head_dim: int) -> None:
    layout = replace(LAYOUT, dtype=dtype, head_dim=head_dim)
    kv = KVSlice.whole(layout)
    rng = random.Random(dtype)
    src_cache = torch.randn(layout.cache_shape(20)).to(layout.torch_dtype)
    dst_cache = torch.zeros(layout.cache_shape(16), dtype=layout.torch_dtype)
    src_ids, dst_ids = rng.sample(range(20), 7), torch.tensor(rng.sample(range(16), 7))
    for spec in plan_pieces(kv, 7, 1, 3 * layout.block_bytes * 2, layers_per_piece=2):
        buffer = torch.empty(spec.nbytes(kv), dtype=torch.uint8)
        taken = gather(src_cache, src_ids, spec, kv, buffer)
        assert taken == digest(buffer)  # hashed while gathering == hashed afterwards
        staged = piece_view(buffer, spec, kv)
        assert scatter_piece(staged, dst_cache, dst_ids, spec, kv) == taken
    assert torch.equal(dst_cache[:, :, dst_ids].view(torch.uint8),
                       src_cache[:, :, src_ids].view(torch.uint8))
    untouched = sorted(set(range(16)) - set(dst_ids.tolist()))
    assert not dst_cache[:, :, untouched].view(torch.uint8).any()


def test_a_single_kv_piece_gathers_and_scatters_only_its_half() -> None:
    src = torch.randn(LAYOUT.cache_shape(6)).to(LAYOUT.torch_dtype)
    dst = torch.zeros(LAYOUT.cache_shape(6), dtype=LAYOUT.torch_dtype)
    spec = PieceSpec(0, 1, 3, 0, 2, kv_start=1, kv_end=2)  # V of layers 1-2, 2 blocks
    kv = KVSlice.whole(LAYOUT)
    buffer = torch.empty(spec.nbytes(kv), dtype=torch.uint8)
    gather(src, [4, 0], spec, kv, buffer)
    scatter_piece(piece_view(buffer, spec, kv), dst, torch.tensor([1, 5]), spec, kv)
    assert torch.equal(dst[1:3, 1, [1, 5]], src[1:3, 1, [4, 0]])
    assert not dst[:, 0].view(torch.uint8).any() and not dst[0].view(torch.uint8).any()


@pytest.mark.parametrize("bad", [-1, 9])
def test_gather_refuses_source_ids_outside_the_cache(bad: int) -> None:
    # the gather clips ids for speed, so a bad id must be refused before it copies anything
    with pytest.raises(IndexError, match=r"\[0, 9\)"):
        checked_ids(torch.tensor([3, bad]).numpy(), 9)


def _piece_bytes(seed: int) -> torch.Tensor:
    """A realistic piece: fp16 KV of 8 blocks x 2 KiB."""
    return torch.randn(8, 1024, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


@pytest.mark.parametrize("kind", [digest, device_digest], ids=["host-xxh3", "device-modp"])
def test_digests_detect_a_flipped_bit_swapped_blocks_a_zeroed_and_a_truncated_piece(
        kind: object) -> None:
    """Both digests (the device one runs on CPU tensors here, with the same torch ops it runs
    on CUDA) change for each corruption a transfer could suffer."""
    fn = kind  # type: ignore[assignment]
    piece = _piece_bytes(0)
    base = fn(piece)
    assert fn(piece.clone()) == base  # deterministic: sender and receiver agree
    for position in (0, 4097, piece.numel() * 2 - 1):
        for bit in (0, 7):
            flipped = piece.clone()
            flipped.view(torch.uint8).view(-1)[position] ^= 1 << bit
            assert fn(flipped) != base, (position, bit)
    swapped = piece.clone()
    swapped[[2, 5]] = piece[[5, 2]]
    assert fn(swapped) != base
    assert fn(torch.zeros_like(piece)) != base
    assert fn(piece.view(-1)[:-64]) != base  # truncated
    tail_zeroed = piece.clone()
    tail_zeroed.view(-1)[-64:] = 0  # what a short receive into a zeroed buffer leaves
    assert fn(tail_zeroed) != base


def test_device_digest_handles_every_word_size_and_large_pieces_in_chunks() -> None:
    import pdserve.handoff.digest as digest_module

    data = torch.arange(4099, dtype=torch.uint8)  # odd: byte words
    assert device_digest(data) != device_digest(data[:-1])  # 4098: 16-bit words
    assert device_digest(data[:-3]) != device_digest(data[:-2])  # 4096: 32-bit words
    big = _piece_bytes(1)
    whole = device_digest(big)
    chunk = digest_module._CHUNK_WORDS
    try:
        digest_module._CHUNK_WORDS = 1000  # many chunks: the same sums
        assert device_digest(big) == whole
    finally:
        digest_module._CHUNK_WORDS = chunk


def test_host_digest_is_xxh3_and_the_fence_digest_depends_on_every_field() -> None:
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
    from pdserve.handoff.transport import _ucx_buffer

    strided = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="non-contiguous"):
        check_contiguous(strided)
    with pytest.raises(ValueError, match="non-contiguous"):
        _ucx_buffer(strided)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_ranges_split_to_and_merge_from_the_ranks_of_a_tp_group(dtype: str) -> None:
    """A whole cache's KV heads go to the two ranks of a TP group (each its half, gathered
    from strided views of whole blocks), then from the ranks back into one whole cache: every
    byte lands in its head, nothing else is written."""
    whole = replace(LAYOUT, dtype=dtype, num_kv_heads=4)
    halves = [replace(whole, tp_rank=rank, tp_size=2) for rank in range(2)]
    src = torch.randn(whole.cache_shape(10)).to(whole.torch_dtype)
    src_ids, dst_ids, back_ids = [7, 2, 9], [4, 0, 5], [1, 3, 2]
    ranks = [torch.zeros(h.cache_shape(6), dtype=h.torch_dtype) for h in halves]
    merged = torch.zeros(whole.cache_shape(4), dtype=whole.torch_dtype)
    for rank, half in enumerate(halves):
        for send, receive, source, ids, target, target_ids in (
                (KVSlice(whole, half.kv_heads), KVSlice.whole(half), src, src_ids, ranks[rank],
                 dst_ids),
                (KVSlice.whole(half), KVSlice(whole, half.kv_heads), ranks[rank], dst_ids,
                 merged, back_ids)):
            for spec in plan_pieces(send, 3, 1, 2 * send.block_bytes, layers_per_piece=2):
                assert spec.nbytes(send) == spec.nbytes(receive)
                buffer = torch.empty(spec.nbytes(send), dtype=torch.uint8)
                taken = gather(source, ids, spec, send, buffer)
                staged = piece_view(buffer, spec, receive)
                assert scatter_piece(staged, target, torch.tensor(target_ids), spec,
                                     receive) == taken
        start, end = half.kv_heads
        assert torch.equal(ranks[rank][:, :, dst_ids].view(torch.uint8),
                           src[:, :, src_ids, :, start:end].view(torch.uint8))
    assert torch.equal(merged[:, :, back_ids].view(torch.uint8),
                       src[:, :, src_ids].view(torch.uint8))
    assert not merged[:, :, [0]].view(torch.uint8).any()
