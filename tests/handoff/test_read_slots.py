"""Read slots without UCX: sealed records, the region's counts and bells, the futex that wakes a
sleeping reader, slot leases, and the watcher that hands records on in order (over a region in
this process's memory, standing in for a peer's mapped one)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.handoff.errors import HandoffError
from pdserve.handoff.futex import FUTEX_AVAILABLE, futex_wait, futex_wake
from pdserve.handoff.piece_plan import PieceSpec
from pdserve.handoff.read_slots import (
    KIND_FENCE,
    KIND_PIECE,
    NUM_SLOTS,
    REGION_BYTES,
    SLOT_RECORDS,
    SlotBegin,
    SlotRegion,
    SlotTable,
    begin_records,
    claim_mark,
    decode_begin_head,
    decode_begin_ids,
    decode_record,
    fence_record,
    num_begin_records,
    piece_record,
)
from pdserve.handoff.slot_watch import BAD_RECORD_S, SlotWatcher
from pdserve.handoff.ucp_memory import PeerMemory

pytestmark = pytest.mark.skipif(not FUTEX_AVAILABLE, reason="read slots need Linux futexes")
SPEC = PieceSpec(5, 2, 4, 16, 48, 0, 2)  # index 5, layers 2-3, blocks 16-47, K and V


def test_records_round_trip_and_refuse_anything_else() -> None:
    record = piece_record(SPEC, 123456, 0xDEADBEEFCAFEF00D, tag=99)
    assert decode_record(record, 99) == (KIND_PIECE, {
        "index": 5, "layers": [2, 4], "kv": [0, 2], "blocks": [16, 48], "nbytes": 123456,
        "digest": 0xDEADBEEFCAFEF00D})
    fence = fence_record(7, 1 << 40, 2**64 - 1, 31, 1000, tag=2**64 - 1)
    assert decode_record(fence, 2**64 - 1) == (KIND_FENCE, {
        "num_pieces": 7, "nbytes": 1 << 40, "digest": 2**64 - 1, "first_token_id": 31,
        "num_tokens": 1000})
    assert decode_record(record, 98) is None  # another lease of the slot: stale
    for word in range(8):  # a torn or tampered record, whichever word
        broken = record.copy()
        broken[word] ^= np.uint64(1 << 17)
        assert decode_record(broken, 99) is None


def region() -> tuple[np.ndarray, SlotRegion]:
    array = np.zeros(REGION_BYTES, np.uint8)
    return array, SlotRegion(array)


def test_published_counts_are_clamped_to_the_slot() -> None:
    array, slots = region()
    slots.publish(3, 0, piece_record(SPEC, 1, 2, tag=1))
    assert slots.published(3) == 1 and slots.published(4) == 0
    assert decode_record(slots.record(3, 0), 1) is not None
    counts = array[64 * 64:].reshape(NUM_SLOTS, -1)[:, :4].view("<u4")
    counts[3, 0] = 1 << 31  # a lying sender: never read past the slot's records
    assert slots.published(3) == SLOT_RECORDS
    slots.open(3, tag=77, transfer_id=9)  # a new lease: nothing published, header rewritten
    assert slots.published(3) == 0 and slots.header(3) == (77, 9)


def test_a_rung_bell_wakes_a_sleeping_reader_and_a_moved_one_does_not_sleep() -> None:
    _, slots = region()
    woke = threading.Event()
    seen = slots.bell(7)

    def reader() -> None:
        slots.wait(7, seen, timeout_s=30)
        woke.set()

    thread = threading.Thread(target=reader)
    thread.start()
    started = time.monotonic()
    while not woke.is_set():  # ring until it wakes: the reader may not be asleep yet
        slots.ring(7)
        woke.wait(0.01)
    thread.join()
    assert time.monotonic() - started < 10  # woken, not timed out (30 s)
    assert slots.bell(7) != seen
    started = time.monotonic()
    slots.wait(7, seen, timeout_s=30)  # the word moved on: returns at once
    assert time.monotonic() - started < 10


def test_futex_wait_times_out_when_nobody_rings() -> None:
    word = np.zeros(1, "<u4")
    started = time.monotonic()
    futex_wait(word.ctypes.data, 0, 0.05)
    assert 0.02 <= time.monotonic() - started < 10  # it slept (a signal could cut it short)
    futex_wake(word.ctypes.data)  # nobody sleeps: harmless


def test_slot_leases_run_out_and_come_back_with_a_new_tag() -> None:
    table = SlotTable(torch.zeros(REGION_BYTES, dtype=torch.uint8), b"rkey")
    leases = [table.lease(b"receiver-a", tid, 12) for tid in range(NUM_SLOTS)]
    assert all(lease is not None for lease in leases)
    assert len({lease.slot for lease in leases if lease}) == NUM_SLOTS
    assert len({lease.bell for lease in leases if lease}) == 1  # one bell per receiver
    assert table.lease(b"receiver-a", 99, 12) is None  # the transfer announces by frames then
    first = leases[0]
    assert first is not None
    first.publish(0, piece_record(SPEC, 1, 2, first.tag))
    table.release(first)
    again = table.lease(b"receiver-a", 100, 12)
    assert again is not None and again.slot == first.slot and again.tag != first.tag
    assert again.region.published(again.slot) == 0  # the old records are not counted
    assert again.region.header(again.slot) == (again.tag, 100)
    assert decode_record(again.region.record(again.slot, first.first), again.tag) is None


class _Record:
    """Stands in for an InboundTransfer: the watcher asks whether it ended and how many
    blocks it has (its records follow that many begin records)."""

    def __init__(self) -> None:
        self.terminal = False
        self.request_id = "req"
        self.num_blocks = 12


FIRST = num_begin_records(12)  # where a followed transfer's piece records start


class _Handlers:
    def __init__(self) -> None:
        self.records: list[tuple[Any, int, dict[str, Any]]] = []
        self.errors: list[tuple[Any, HandoffError]] = []
        self.changed = threading.Condition()

    def on_record(self, record: Any, kind: int, body: dict[str, Any]) -> bool:
        with self.changed:
            self.records.append((record, kind, body))
            self.changed.notify_all()
        return kind != KIND_FENCE

    def on_error(self, record: Any, error: HandoffError) -> None:
        with self.changed:
            self.errors.append((record, error))
            self.changed.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout)


def watched_region() -> tuple[SlotRegion, PeerMemory, _Handlers, SlotWatcher]:
    array = np.zeros(REGION_BYTES, np.uint8)
    memory = PeerMemory(4096, REGION_BYTES, array)
    handlers = _Handlers()
    watcher = SlotWatcher("test-slots", memory, 3, handlers.on_record, handlers.on_error)
    return SlotRegion(array), memory, handlers, watcher


def test_the_watcher_hands_on_records_in_order_until_the_fence() -> None:
    slots, memory, handlers, watcher = watched_region()
    try:
        record = _Record()
        slots.publish(9, FIRST + 0, piece_record(SPEC, 10, 11, tag=5))  # before it was followed
        watcher.follow(record, slot=9, tag=5)
        assert handlers.wait_for(lambda: len(handlers.records) == 1)
        for position in (1, 2):
            slots.publish(9, FIRST + position, piece_record(SPEC, 10, 20 + position, tag=5))
            slots.ring(3)
        slots.publish(9, FIRST + 3, fence_record(3, 30, 0, 1, 4, tag=5))
        slots.ring(3)
        assert handlers.wait_for(lambda: len(handlers.records) == 4)
        kinds = [kind for _, kind, _ in handlers.records]
        assert kinds == [KIND_PIECE, KIND_PIECE, KIND_PIECE, KIND_FENCE]
        assert [body.get("digest") for _, _, body in handlers.records[:3]] == [11, 21, 22]
        slots.publish(9, FIRST + 4, piece_record(SPEC, 10, 99, tag=5))  # after the fence: ignored
        slots.ring(3)
        other = _Record()  # a second transfer on the same watcher still gets its records
        slots.publish(10, FIRST + 0, fence_record(0, 0, 0, 1, 4, tag=6))
        watcher.follow(other, slot=10, tag=6)
        assert handlers.wait_for(lambda: len(handlers.records) == 5)
        assert handlers.records[-1][0] is other and len(handlers.records) == 5
        assert handlers.errors == []
    finally:
        watcher.stop()


def test_a_record_that_never_passes_its_check_fails_the_transfer() -> None:
    slots, _, handlers, watcher = watched_region()
    try:
        record = _Record()
        slots.publish(2, FIRST + 0, piece_record(SPEC, 10, 11, tag=1234))  # sealed with another tag
        started = time.monotonic()
        watcher.follow(record, slot=2, tag=77)
        assert handlers.wait_for(lambda: handlers.errors, timeout=BAD_RECORD_S + 10)
        assert time.monotonic() - started >= BAD_RECORD_S
        assert handlers.errors[0][0] is record
        assert "fails its check" in str(handlers.errors[0][1])
        assert handlers.records == []
    finally:
        watcher.stop()


def test_an_ended_transfer_is_dropped_and_a_stopped_watcher_lets_the_region_go() -> None:
    slots, memory, handlers, watcher = watched_region()
    assert memory._pins == 1  # held while watching: unmapping waits for the watcher
    record = _Record()
    record.terminal = True
    slots.publish(1, FIRST + 0, piece_record(SPEC, 10, 11, tag=8))
    watcher.follow(record, slot=1, tag=8)
    watcher.stop()
    watcher._thread.join(10)
    assert not watcher._thread.is_alive()
    assert handlers.records == []  # it had ended: nothing handed on
    assert memory._pins == 0
    memory.close()
    assert not memory.pin()  # closed: no reader may start on it


def test_a_failing_handler_ends_that_transfer_and_the_watcher_serves_the_next() -> None:
    slots, memory, handlers, watcher = watched_region()
    try:
        calls = []

        def flaky(record: Any, kind: int, body: dict[str, Any]) -> bool:
            calls.append(record)
            if len(calls) == 1:
                raise RuntimeError("handler bug")
            return handlers.on_record(record, kind, body)

        watcher._on_record = flaky
        first, second = _Record(), _Record()
        slots.publish(4, FIRST + 0, piece_record(SPEC, 10, 11, tag=3))
        watcher.follow(first, slot=4, tag=3)
        assert handlers.wait_for(lambda: handlers.errors)
        assert handlers.errors[0][0] is first and "handler bug" in str(handlers.errors[0][1])
        slots.publish(5, FIRST + 0, piece_record(SPEC, 10, 12, tag=4))
        watcher.follow(second, slot=5, tag=4)
        assert handlers.wait_for(lambda: handlers.records)
        assert handlers.records[0][0] is second and watcher.alive
    finally:
        watcher.stop()


def a_begin(num_blocks: int, tid: int = 41) -> SlotBegin:
    ids = np.arange(1000, 1000 + num_blocks, dtype=np.int64)[::-1].copy()
    return SlotBegin(tid, num_blocks, 5000, 1 << 40, 0xABC, 2**63 + 5, ids)


@pytest.mark.parametrize("num_blocks", [1, 12, 13, 30])
def test_begin_records_round_trip_and_refuse_any_flipped_word(num_blocks: int) -> None:
    begin = a_begin(num_blocks)
    records = begin_records(begin, tag=7)
    assert len(records) == num_begin_records(num_blocks)
    head = decode_begin_head(records[0], 7)
    assert head is not None and head.transfer_id == 41 and head.num_blocks == num_blocks
    decoded = decode_begin_ids(head, records[1:], 7)
    assert decoded is not None and decoded.instance == begin.instance
    assert decoded.block_ids.tolist() == begin.block_ids.tolist()
    assert decode_begin_head(records[0], 8) is None  # another lease's tag
    assert decode_begin_head(records[1], 7) is None  # an ids record is not a begin record
    for position in range(len(records)):
        broken = records.copy()
        broken[position, 3] ^= np.uint64(1)
        ok = (decode_begin_head(broken[0], 7) is not None
              and decode_begin_ids(head, broken[1:], 7) is not None)
        assert not ok


class _Claims:
    """A claim handler: takes the transfers it was told to, counts every offer."""

    def __init__(self, handlers: _Handlers, ours: dict[int, _Record]) -> None:
        self.ours, self.offers, self.handlers = ours, [], handlers

    def __call__(self, slot: int, tag: int, begin: SlotBegin) -> Any:
        with self.handlers.changed:
            self.offers.append((slot, tag, begin.transfer_id, begin.block_ids.tolist()))
            self.handlers.changed.notify_all()
        return self.ours.get(begin.transfer_id)


def test_the_watcher_offers_slots_begun_by_the_sender_and_follows_those_claimed() -> None:
    array = np.zeros(REGION_BYTES, np.uint8)
    memory = PeerMemory(4096, REGION_BYTES, array)
    handlers = _Handlers()
    record = _Record()
    claims = _Claims(handlers, {41: record})
    watcher = SlotWatcher("test-slots", memory, 3, handlers.on_record, handlers.on_error,
                          claims)
    slots = SlotRegion(array)
    try:
        mine, theirs = a_begin(12, tid=41), a_begin(5, tid=42)
        slots.open(6, tag=70, transfer_id=42)  # another receiver's transfer: offered, refused
        slots.publish_many(6, begin_records(theirs, 70))
        slots.count_begin(3)
        slots.open(9, tag=90, transfer_id=41)
        records = begin_records(mine, 90)
        slots.publish_many(9, records[:1])  # begin records not all out yet: not offered
        slots.count_begin(3)
        slots.ring(3)
        assert handlers.wait_for(lambda: len(claims.offers) == 1)
        assert claims.offers[0][:3] == (6, 70, 42)
        slots.publish_many(9, records)  # now visible: looked at again (within BAD_RECORD_S)
        slots.publish(9, len(records), piece_record(SPEC, 10, 11, tag=90))
        slots.ring(3)
        assert handlers.wait_for(lambda: len(handlers.records) == 1)
        assert handlers.records[0][0] is record and handlers.records[0][2]["digest"] == 11
        assert claims.offers[1] == (9, 90, 41, mine.block_ids.tolist())
        # The claimed slot carries the mark its sender looks for; the refused one none.
        assert slots.claimed(9) == claim_mark(90, mine.instance) and slots.claimed(6) == 0
        assert claim_mark(90, mine.instance + 1) != claim_mark(90, mine.instance)
        slots.publish(9, len(records) + 1, fence_record(1, 10, 0, 1, 4, tag=90))
        slots.ring(3)
        assert handlers.wait_for(lambda: len(handlers.records) == 2)
        slots.publish(7, 0, piece_record(SPEC, 1, 2, tag=1))  # no begin record: never offered
        slots.ring(3)
        later, other = a_begin(3, tid=43), _Record()  # a later transfer: once it is handed
        claims.ours[43] = other  # on, the scans before it have seen slots 6, 7 and 9 again
        slots.open(11, tag=110, transfer_id=43)
        slots.publish_many(11, begin_records(later, 110))
        slots.count_begin(3)
        slots.publish(11, num_begin_records(3), fence_record(0, 0, 0, 1, 4, tag=110))
        slots.ring(3)
        assert handlers.wait_for(lambda: len(handlers.records) == 3)
        assert handlers.records[-1][0] is other
        assert [offer[0] for offer in claims.offers] == [6, 9, 11]  # each slot offered once
        assert handlers.errors == []
    finally:
        watcher.stop()
