"""Same-host reads without UCX: the copy-and-hash that lands a read piece, the sender's digest
of pieces in place, the SOURCE checks, and the record's rules for read pieces."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv_cache import allocate_kv_cache
from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.config import HandoffConfig
from pdserve.handoff.errors import HandoffProtocolError
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.kvcopy import cache_rows, digest_rows, gather_piece, piece_view, read_piece
from pdserve.handoff.piece_plan import PieceSpec, plan_pieces
from pdserve.handoff.sessions import SenderSession
from pdserve.handoff.source_reads import ReadSource, SourceMaps

LAYOUT = KVLayout("fp", "float16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
CACHE_BLOCKS = 40


def random_cache(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.cache_shape(CACHE_BLOCKS), generator=generator).to(torch.float16)


def gathered(cache: torch.Tensor, ids: list[int], spec: PieceSpec) -> bytes:
    """Reference: the piece's bytes in wire order, via the staged path's gather."""
    out = torch.empty(spec.nbytes(LAYOUT), dtype=torch.uint8)
    gather_piece(cache, torch.tensor(ids), spec, LAYOUT, piece_view(out, spec, LAYOUT))
    return out.numpy().tobytes()


block_lists = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.permutations(range(CACHE_BLOCKS)).map(lambda p, n=n: p[:n]),
    st.permutations(range(CACHE_BLOCKS)).map(lambda p, n=n: p[:n]),
    st.booleans()))


@settings(max_examples=60, deadline=None)
@given(block_lists, st.integers(1, 3))
def test_read_piece_lands_exactly_the_piece_and_hashes_what_landed(
        lists: tuple[list[int], list[int], bool], layers_per_piece: int) -> None:
    src_ids, dst_ids, sorted_runs = lists
    if sorted_runs:  # long runs on both sides: the straight path
        src_ids, dst_ids = sorted(src_ids), sorted(dst_ids)
    src, dst = random_cache(1), random_cache(2)
    untouched = dst.clone()
    for spec in plan_pieces(LAYOUT, len(src_ids), 1, 1 << 20, layers_per_piece):
        actual = read_piece(cache_rows(src, LAYOUT), np.array(src_ids), cache_rows(dst, LAYOUT),
                            np.array(dst_ids), spec)
        expected = gathered(src, src_ids, spec)
        assert gathered(dst, dst_ids, spec) == expected
        assert actual == xxhash.xxh3_64_intdigest(expected)
        assert actual == digest_rows(cache_rows(src, LAYOUT), np.array(src_ids), spec)
    others = [b for b in range(CACHE_BLOCKS) if b not in dst_ids]
    assert torch.equal(dst[:, :, others], untouched[:, :, others])


def test_a_corrupted_read_changes_the_digest() -> None:
    src, dst = random_cache(3), random_cache(4)
    ids = list(range(5))
    spec = plan_pieces(LAYOUT, 5, 1, 1 << 20, 1)[0]
    rows = cache_rows(src, LAYOUT), cache_rows(dst, LAYOUT)
    clean = read_piece(rows[0], np.array(ids), rows[1], np.array(ids), spec)
    bad = read_piece(rows[0], np.array(ids), rows[1], np.array(ids), spec, corrupt=True)
    assert bad != clean and gathered(dst, ids, spec) != gathered(src, ids, spec)


class _NoMapping:
    """A transport stand-in: every check under test happens before any mapping."""

    def map_peer_memory(self, *args: object) -> None:
        raise AssertionError("mapped memory although the SOURCE was invalid")


def session() -> SenderSession:
    loop = asyncio.new_event_loop()
    try:
        return SenderSession(1, "host", b"n", b"n", time.monotonic(), loop.create_future())
    finally:
        loop.close()


@pytest.mark.parametrize(("changes", "reason"), [
    ({"cache_blocks": 0}, "cache of 0 blocks"),
    ({"blocks": np.arange(3, dtype="<u4").tobytes()}, "lists 3 block ids, 4 were reserved"),
    ({"blocks": np.array([1, 2, 3, 40], dtype="<u4").tobytes()}, "outside the sender's 40"),
])
def test_source_refusals(changes: dict, reason: str) -> None:
    body = {"tid": 1, "rkey": b"k", "address": 4096, "cache_blocks": CACHE_BLOCKS,
            "blocks": np.arange(4, dtype="<u4").tobytes(), **changes}
    maps = SourceMaps(_NoMapping())  # type: ignore[arg-type]
    with pytest.raises(HandoffProtocolError, match=reason):
        maps.source_for(session(), LAYOUT, 4, body)


def test_a_source_without_an_endpoint_back_is_refused() -> None:
    body = {"tid": 1, "rkey": b"k", "address": 4096, "cache_blocks": CACHE_BLOCKS,
            "blocks": np.arange(4, dtype="<u4").tobytes()}
    with pytest.raises(HandoffProtocolError, match="no endpoint back"):
        SourceMaps(_NoMapping()).source_for(session(), LAYOUT, 4, body)  # type: ignore[arg-type]


def test_read_pieces_need_a_source_and_pushed_pieces_must_not_have_one() -> None:
    ids = (10, 11, 12, 13)
    record = InboundTransfer("req", 77, LAYOUT, torch.tensor(ids), ids, 15,
                             time.monotonic() + 10, 1 << 20, instance=5)
    record.accept_begin(9, {"tid": 77, "instance": 5, "request_id": "req",
                            "layout": LAYOUT.to_dict(), "num_blocks": 4, "pid": 1})
    header = {"index": 0, "layers": [0, 1], "kv": [0, 2], "blocks": [0, 4],
              "nbytes": 4 * LAYOUT.block_bytes, "digest": 0}
    with pytest.raises(HandoffProtocolError, match="without a SOURCE"):
        record.accept_piece(9, header, read=True)
    source = ReadSource(np.zeros((3, 2, 4, 8), np.uint8), np.arange(4))
    with pytest.raises(HandoffProtocolError, match="did not begin"):
        record.accept_source(8, source)
    record.accept_source(9, source)
    with pytest.raises(HandoffProtocolError, match="pushed piece after a SOURCE"):
        record.accept_piece(9, header, read=False)
    record.accept_piece(9, header, read=True)
    with pytest.raises(HandoffProtocolError, match="SOURCE after pieces"):
        record.accept_source(9, source)


def test_same_host_reads_setting_parses_from_the_environment() -> None:
    env = {"PDSERVE_HANDOFF_AUTH_TOKEN": "t", "PDSERVE_HANDOFF_SAME_HOST_READS": "false"}
    assert HandoffConfig.from_env(env).same_host_reads is False
    assert HandoffConfig.from_env({**env, "PDSERVE_HANDOFF_SAME_HOST_READS": "1"}).same_host_reads
    with pytest.raises(ValueError, match="SAME_HOST_READS='maybe'"):
        HandoffConfig.from_env({**env, "PDSERVE_HANDOFF_SAME_HOST_READS": "maybe"})


def test_kv_cache_lives_in_the_memory_a_provider_hands_out() -> None:
    backing = torch.full((LAYOUT.num_layers * LAYOUT.block_bytes * 6 + 64,), 7, dtype=torch.uint8)
    cache = allocate_kv_cache(LAYOUT, 6, "cpu", host_memory=lambda n: backing)
    assert cache.data_ptr() == backing.data_ptr() and cache.shape == LAYOUT.cache_shape(6)
    assert not cache.any() and cache.dtype == torch.float16  # zeroed, typed
    with pytest.raises(ValueError, match="need"):
        allocate_kv_cache(LAYOUT, 6, "cpu", host_memory=lambda n: torch.zeros(n // 2,
                                                                              dtype=torch.uint8))
