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
from pdserve.handoff import kvcopy
from pdserve.handoff.config import HandoffConfig
from pdserve.handoff.errors import HandoffProtocolError
from pdserve.handoff.inbound import InboundState, InboundTransfer
from pdserve.handoff.kvcopy import (
    cache_rows,
    digest_rows,
    gather_piece,
    joint_runs,
    piece_view,
    read_piece,
)
from pdserve.handoff.piece_plan import PieceSpec, plan_pieces
from pdserve.handoff.sessions import SenderSession
from pdserve.handoff.source_reads import ReadSource, SlotFeed, SourceMaps
from pdserve.handoff.ucp_memory import PeerMemory

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
        runs = joint_runs(src_ids, dst_ids)  # the transfer's runs, found once, clipped per piece
        assert read_piece(cache_rows(src, LAYOUT), np.array(src_ids), cache_rows(dst, LAYOUT),
                          np.array(dst_ids), spec, runs) == actual
        assert digest_rows(cache_rows(src, LAYOUT), np.array(src_ids), spec,
                           joint_runs(src_ids)) == actual
    others = [b for b in range(CACHE_BLOCKS) if b not in dst_ids]
    assert torch.equal(dst[:, :, others], untouched[:, :, others])


def test_digest_rows_hashes_long_runs_in_place_and_gathers_short_ones_alike(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src = random_cache(5)
    ids = [3, 4, 5, 6, 7, 20, 9, 10, 11]  # runs of 5, 1 and 3 blocks
    rows = cache_rows(src, LAYOUT)
    spec = plan_pieces(LAYOUT, len(ids), 1, 1 << 20, LAYOUT.num_layers)[0]
    expected = xxhash.xxh3_64_intdigest(gathered(src, ids, spec))
    assert digest_rows(rows, np.array(ids), spec) == expected  # runs shorter than a chunk

    def no_gather(_: np.ndarray) -> np.ndarray:
        raise AssertionError("gathered although every run reaches a chunk")

    monkeypatch.setattr(kvcopy, "READ_CHUNK_BYTES", rows.shape[-1])  # a chunk is one block
    monkeypatch.setattr(kvcopy, "flat_rows", no_gather)
    assert digest_rows(rows, np.array(ids), spec) == expected


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


def no_slots(*_: object) -> None:
    raise AssertionError("a refused SOURCE must not reach the slot watcher")


def source_maps() -> SourceMaps:
    return SourceMaps(_NoMapping(), no_slots, no_slots, no_slots)  # type: ignore[arg-type]


def begun_record(ids: tuple[int, ...] = (10, 11, 12, 13),
                 reads_offered: bool = True) -> InboundTransfer:
    record = InboundTransfer("req", 77, LAYOUT, torch.tensor(ids), ids, 15,
                             time.monotonic() + 10, 1 << 20, instance=5,
                             reads_offered=reads_offered)
    record.accept_begin(9, {"tid": 77, "instance": 5, "request_id": "req",
                            "layout": LAYOUT.to_dict(), "num_blocks": len(ids), "pid": 1})
    return record


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
    body = {**source_body(), **changes}
    with pytest.raises(HandoffProtocolError, match=reason):
        source_maps().source_for(session(), begun_record(), body)


def source_body(**slots: object) -> dict[str, object]:
    return {"tid": 1, "rkey": b"k", "address": 4096, "cache_blocks": CACHE_BLOCKS,
            "blocks": np.arange(4, dtype="<u4").tobytes(), "slots_rkey": b"", "slots_address": 0,
            "slot": 0, "slot_tag": 0, "bell": 0, **slots}


def test_a_source_for_a_ticket_that_offered_no_reads_is_refused_before_mapping() -> None:
    """A CUDA cache or ``same_host_reads`` off: the ticket said no, whatever the sender says."""
    with pytest.raises(HandoffProtocolError, match="offered no reads"):
        source_maps().source_for(session(), begun_record(reads_offered=False), source_body())


def test_a_source_without_an_endpoint_back_is_refused() -> None:
    with pytest.raises(HandoffProtocolError, match="no endpoint back"):
        source_maps().source_for(session(), begun_record(), source_body())


@pytest.mark.parametrize(("slots", "reason"), [
    ({"slot": 64}, "slot 64"), ({"slot": -1}, "slot -1"), ({"bell": 64}, "bell 64"),
    ({"slot_tag": -5}, "tag -5"),
])
def test_a_source_naming_an_impossible_slot_is_refused(slots: dict, reason: str) -> None:
    """Checked before the region is mapped: nothing past the slots a region holds is read."""
    body = source_body(slots_rkey=b"s", slots_address=8192, **slots)
    maps = SourceMaps(_Mapping(), no_slots, no_slots, no_slots)  # type: ignore[arg-type]
    with pytest.raises(HandoffProtocolError, match=reason):
        maps.source_for(endpoint_session(), begun_record(), body)


class _Mapping:
    """A transport stand-in that maps the cache (any bytes will do for the checks here)."""

    def map_peer_memory(self, endpoint: object, rkey: bytes, address: int,
                        nbytes: int, writable: bool = False) -> object:
        from pdserve.handoff.ucp_memory import PeerMemory

        return PeerMemory(address, nbytes, np.zeros(nbytes, np.uint8))


def endpoint_session() -> SenderSession:
    loop = asyncio.new_event_loop()
    try:
        endpoint = loop.create_future()
        endpoint.set_result(object())
        return SenderSession(1, "host", b"n", b"n", time.monotonic(), endpoint)
    finally:
        loop.close()


def test_read_pieces_need_a_source_and_pushed_pieces_must_not_have_one() -> None:
    record = begun_record()
    header = {"index": 0, "layers": [0, 1], "kv": [0, 2], "blocks": [0, 4],
              "nbytes": 4 * LAYOUT.block_bytes, "digest": 0}
    with pytest.raises(HandoffProtocolError, match="without a SOURCE"):
        record.accept_piece(9, header, read=True)
    source = read_source()
    with pytest.raises(HandoffProtocolError, match="did not begin"):
        record.accept_source(8, source)
    record.accept_source(9, source)
    with pytest.raises(HandoffProtocolError, match="pushed piece after a SOURCE"):
        record.accept_piece(9, header, read=False)
    record.accept_piece(9, header, read=True)
    with pytest.raises(HandoffProtocolError, match="SOURCE after pieces"):
        record.accept_source(9, source)


def read_source(slot: SlotFeed | None = None) -> ReadSource:
    memory = PeerMemory(4096, 8, np.zeros(8, np.uint8))
    return ReadSource(np.zeros((3, 2, 4, 8), np.uint8), np.arange(4), np.arange(4), [(0, 4)],
                      memory, slot)


def test_a_transfer_takes_its_announcements_from_one_channel() -> None:
    """Announced through a read slot: frames for it are refused, and the reverse."""
    header = {"index": 0, "layers": [0, 1], "kv": [0, 2], "blocks": [0, 4],
              "nbytes": 4 * LAYOUT.block_bytes, "digest": 0}
    framed, slotted = begun_record(), begun_record()
    framed.accept_source(9, read_source())
    slotted.accept_source(9, read_source(SlotFeed(PeerMemory(1, 1, np.zeros(1, np.uint8)),
                                                  3, 7, 1)))
    with pytest.raises(HandoffProtocolError, match="slot the SOURCE did not name"):
        framed.accept_piece(9, header, read=True, slotted=True)
    with pytest.raises(HandoffProtocolError, match="frame for a transfer announced through"):
        slotted.accept_piece(9, header, read=True)
    slotted.accept_piece(9, header, read=True, slotted=True)
    fence = {"num_pieces": 1, "nbytes": 4 * LAYOUT.block_bytes, "digest": 0,
             "first_token_id": 1, "num_tokens": 15}
    with pytest.raises(HandoffProtocolError, match="fence frame for a transfer announced"):
        slotted.accept_fence(9, fence)


def test_a_transfer_begun_in_its_slot_takes_agreeing_frames_and_refuses_others() -> None:
    """Begin records start it once; a late BEGIN or SOURCE (the claim mark came too late
    for the sender) must say the same, from the same session."""
    ids = (10, 11, 12, 13)
    record = InboundTransfer("req", 77, LAYOUT, torch.tensor(ids), ids, 15,
                             time.monotonic() + 10, 1 << 20, instance=5, reads_offered=True)
    source = read_source(SlotFeed(PeerMemory(1, 1, np.zeros(1, np.uint8)), 3, 7, 1))
    assert record.begin_in_slot(9, source) and record.began_in_slot
    assert not record.begin_in_slot(9, source)  # once
    begin = {"tid": 77, "instance": 5, "request_id": "req", "layout": LAYOUT.to_dict(),
             "num_blocks": 4, "pid": 1}
    record.accept_begin(9, begin)
    assert record.sender_pid == 1 and record.session_id == 9
    with pytest.raises(HandoffProtocolError, match="already began"):
        record.accept_begin(8, begin)  # another session
    with pytest.raises(HandoffProtocolError, match="blocks"):
        record.accept_begin(9, {**begin, "num_blocks": 3})
    blocks = np.arange(4, dtype="<u4").tobytes()  # read_source's ids
    record.check_slot_source(9, {"slot": 3, "slot_tag": 7, "blocks": blocks})
    with pytest.raises(HandoffProtocolError, match="names slot 4"):
        record.check_slot_source(9, {"slot": 4, "slot_tag": 7, "blocks": blocks})
    with pytest.raises(HandoffProtocolError, match="other blocks"):
        record.check_slot_source(9, {"slot": 3, "slot_tag": 7, "blocks": blocks[::-1]})
    with pytest.raises(HandoffProtocolError, match="did not begin"):
        record.check_slot_source(8, {"slot": 3, "slot_tag": 7, "blocks": blocks})
    unoffered = InboundTransfer("req", 78, LAYOUT, torch.tensor(ids), ids, 15,
                                time.monotonic() + 10, 1 << 20, instance=5)
    assert not unoffered.begin_in_slot(9, source)  # still reserved, but offered no reads
    assert unoffered.state is InboundState.RESERVED


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
