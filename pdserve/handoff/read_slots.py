"""Read slots: how a same-host sender announces the pieces a receiver reads itself (and the
fence) through shared memory, instead of a UCX frame per piece through both event loops.

The sender exports one region of ``REGION_BYTES``: ``NUM_BELLS`` bells (64-byte lines: a u32
futex word, then a u32 count of slots opened for that bell's receivers) then ``NUM_SLOTS``
slots. A read transfer leases a slot; a slot is a header line (u32 count of published
records; u64 words 1 to 3: the lease's tag, the transfer id, and the mark a receiver that
started from the begin records leaves, `claim_mark`) and ``SLOT_RECORDS``
records of eight little-endian u64. The caller of ``start_transfer`` first publishes the
begin records (`begin_records`: the transfer's identity and its source block ids), so a
receiver already watching this sender can start reading without waiting for the BEGIN and
SOURCE frames; then the compute thread writes record ``n`` (a piece's bounds and digest, or
the fence), sets the count to ``n + 1``, bumps its receiver's bell and wakes it (futex). The
eighth word of a record is a check, xxh3-64 of the other seven seeded with the lease's random
tag, so a reader never acts on a record that is torn, stale, from another use of the slot,
or not yet visible (weakly ordered CPUs); the receiver checks a valid record exactly like a
PIECE or FENCE frame.
"""

from __future__ import annotations

import json
import math
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.handoff.futex import futex_wait, futex_wake
from pdserve.handoff.piece_plan import PieceSpec

LINE_BYTES = 64
NUM_BELLS = 64
NUM_SLOTS = 64
SLOT_RECORDS = 255
SLOT_BYTES = LINE_BYTES * (1 + SLOT_RECORDS)  # 16 KiB
REGION_BYTES = LINE_BYTES * NUM_BELLS + NUM_SLOTS * SLOT_BYTES
MAX_SLOT_RECORDS = SLOT_RECORDS - 1  # begin and piece records; the last holds the fence
KIND_PIECE, KIND_FENCE, KIND_BEGIN, KIND_IDS = 1, 2, 3, 4
IDS_PER_RECORD = 12  # u32 source block ids in one KIND_IDS record
_WORDS = LINE_BYTES // 8  # u64 per record
_U32_PER_LINE = LINE_BYTES // 4


def _pair(low: int, high: int) -> int:
    return low | high << 32


def _unpair(word: int) -> list[int]:
    return [word & 0xFFFFFFFF, word >> 32]


def _sealed(words: list[int], tag: int) -> np.ndarray:
    record = np.array([*words, 0], dtype="<u8")
    record[7] = xxhash.xxh3_64_intdigest(record[:7].tobytes(), seed=tag)
    return record


def piece_record(spec: PieceSpec, nbytes: int, digest: int, tag: int) -> np.ndarray:
    return _sealed([KIND_PIECE, spec.index, _pair(spec.layer_start, spec.layer_end),
                    _pair(spec.kv_start, spec.kv_end), _pair(spec.block_start, spec.block_end),
                    nbytes, digest], tag)


def fence_record(num_pieces: int, nbytes: int, digest: int, first_token_id: int,
                 num_tokens: int, tag: int) -> np.ndarray:
    return _sealed([KIND_FENCE, num_pieces, nbytes, digest, first_token_id, num_tokens, 0], tag)


def num_begin_records(num_blocks: int) -> int:
    """Records a transfer of ``num_blocks`` blocks opens its slot with (its pieces follow)."""
    return 1 + math.ceil(num_blocks / IDS_PER_RECORD)


def identity(request_id: str, layout: dict[str, Any]) -> int:
    """xxh3-64 of a transfer's request id and KV layout fields, as its begin record carries
    them: the receiver compares it with its reservation's."""
    return xxhash.xxh3_64_intdigest(json.dumps([request_id, layout], sort_keys=True).encode())


@dataclass(frozen=True)
class SlotBegin:
    """What a slot's begin records say: the BEGIN and SOURCE of a read transfer."""

    transfer_id: int
    num_blocks: int
    cache_blocks: int
    cache_address: int  # where the exported cache starts in the sender (names its region)
    identity: int  # `identity` of the request id and layout
    instance: int  # the receiver instance the ticket names
    block_ids: np.ndarray  # the sender's source block ids (int64)


def claim_mark(tag: int, instance: int) -> int:
    """What a receiver writes into a slot it started from: bound to the lease and to the
    receiver instance its ticket names, so no other lease or receiver's mark can match."""
    return xxhash.xxh3_64_intdigest(instance.to_bytes(8, "little"), seed=tag) or 1


def begin_records(begin: SlotBegin, tag: int) -> np.ndarray:
    """``[num_begin_records(num_blocks), 8]`` sealed records announcing ``begin``."""
    head = [KIND_BEGIN, begin.transfer_id, begin.num_blocks, begin.cache_blocks,
            begin.cache_address, begin.identity, begin.instance]
    ids = np.zeros(IDS_PER_RECORD * (num_begin_records(begin.num_blocks) - 1), dtype="<u4")
    ids[:begin.num_blocks] = begin.block_ids
    rows = ids.view("<u8").reshape(-1, _WORDS - 2)
    records = [_sealed(head, tag)]
    records += [_sealed([KIND_IDS, *row.tolist()], tag) for row in rows]
    return np.stack(records)


def decode_begin_head(record: np.ndarray, tag: int) -> SlotBegin | None:
    """The begin record's fields (ids still empty), or None if it is not one or fails its check."""
    words = [int(w) for w in record]
    if xxhash.xxh3_64_intdigest(record[:7].tobytes(), seed=tag) != words[7]:
        return None
    if words[0] != KIND_BEGIN:
        return None
    return SlotBegin(*words[1:7], np.empty(0, dtype=np.int64))


def decode_begin_ids(head: SlotBegin, records: np.ndarray, tag: int) -> SlotBegin | None:
    """``head`` with its block ids from the KIND_IDS ``records`` (a private copy), or None if
    any fails its check."""
    for record in records:
        if (int(record[0]) != KIND_IDS or xxhash.xxh3_64_intdigest(
                record[:7].tobytes(), seed=tag) != int(record[7])):
            return None
    ids = np.ascontiguousarray(records[:, 1:7]).view("<u4").reshape(-1)[:head.num_blocks]
    return SlotBegin(head.transfer_id, head.num_blocks, head.cache_blocks, head.cache_address,
                     head.identity, head.instance, ids.astype(np.int64))


def decode_record(record: np.ndarray, tag: int) -> tuple[int, dict[str, Any]] | None:
    """(kind, the PIECE entry or FENCE body it stands for), or None if its check fails.
    ``record`` must be a private copy (the sender may rewrite the slot meanwhile)."""
    words = [int(w) for w in record]
    if xxhash.xxh3_64_intdigest(record[:7].tobytes(), seed=tag) != words[7]:
        return None
    if words[0] == KIND_PIECE:
        return KIND_PIECE, {"index": words[1], "layers": _unpair(words[2]),
                            "kv": _unpair(words[3]), "blocks": _unpair(words[4]),
                            "nbytes": words[5], "digest": words[6]}
    return words[0], {"num_pieces": words[1], "nbytes": words[2], "digest": words[3],
                      "first_token_id": words[4], "num_tokens": words[5]}


class SlotRegion:
    """Views over a slots region: this process's own (sender) or a peer's mapped (receiver)."""

    def __init__(self, array: np.ndarray) -> None:
        if array.dtype != np.uint8 or array.size != REGION_BYTES:
            raise ValueError(f"a slots region is {REGION_BYTES} bytes of uint8")
        self.address = array.ctypes.data
        self._bells = array[:LINE_BYTES * NUM_BELLS].view("<u4")
        slots = array[LINE_BYTES * NUM_BELLS:].reshape(NUM_SLOTS, SLOT_BYTES)
        self._counts = slots[:, :4].view("<u4")  # [NUM_SLOTS, 1]
        # [NUM_SLOTS, 8]: word 1 the lease's tag, 2 the transfer id, 3 the receiver's claim
        self._headers = slots[:, :LINE_BYTES].view("<u8")
        self._records = slots[:, LINE_BYTES:].view("<u8").reshape(NUM_SLOTS, SLOT_RECORDS,
                                                                  _WORDS)

    def published(self, slot: int) -> int:
        return min(int(self._counts[slot, 0]), SLOT_RECORDS)

    def record(self, slot: int, position: int) -> np.ndarray:
        return self._records[slot, position].copy()

    def records(self, slot: int, start: int, stop: int) -> np.ndarray:
        return self._records[slot, start:stop].copy()

    def header(self, slot: int) -> tuple[int, int]:
        """(tag, transfer id) of the slot's current lease (as written: check records with it)."""
        return int(self._headers[slot, 1]), int(self._headers[slot, 2])

    def announced(self) -> np.ndarray:
        """Slots that hold published records."""
        return np.flatnonzero(self._counts[:, 0])

    def open(self, slot: int, tag: int, transfer_id: int) -> None:
        self._counts[slot, 0] = 0
        self._headers[slot, 3] = 0
        self._headers[slot, 1] = tag
        self._headers[slot, 2] = transfer_id

    def claim(self, slot: int, mark: int) -> None:
        """Receiver: it started the slot's transfer from the begin records (`claim_mark`)."""
        self._headers[slot, 3] = mark

    def claimed(self, slot: int) -> int:
        return int(self._headers[slot, 3])

    def publish_many(self, slot: int, records: np.ndarray) -> None:
        """Records ``0 .. len - 1`` at once (a fresh lease's begin records)."""
        self._records[slot, :len(records)] = records
        self._counts[slot, 0] = len(records)

    def publish(self, slot: int, position: int, record: np.ndarray) -> None:
        self._records[slot, position] = record
        self._counts[slot, 0] = position + 1  # after the record: x86 keeps stores in order

    def bell(self, bell: int) -> int:
        return int(self._bells[bell * _U32_PER_LINE])

    def begins(self, bell: int) -> int:
        """How many slots were opened with begin records for this bell's receivers (the
        second word of its line): a watcher looks for new ones only when it moved."""
        return int(self._bells[bell * _U32_PER_LINE + 1])

    def count_begin(self, bell: int) -> None:
        self._bells[bell * _U32_PER_LINE + 1] += np.uint32(1)

    def ring(self, bell: int) -> None:
        """Change the bell word and wake whoever sleeps on it (a lost increment between two
        writers still changes it, which is all a sleeper checks)."""
        self._bells[bell * _U32_PER_LINE] += np.uint32(1)
        futex_wake(self.address + bell * LINE_BYTES)

    def wait(self, bell: int, seen: int, timeout_s: float) -> None:
        """Sleep until the bell is rung (returns at once if it moved past ``seen``)."""
        futex_wait(self.address + bell * LINE_BYTES, seen, timeout_s)


@dataclass(frozen=True)
class SlotLease:
    """One read transfer's slot: the compute thread publishes its records in order."""

    region: SlotRegion
    slot: int
    tag: int
    bell: int
    first: int  # records before the first piece: the begin records
    # Tests: a bit flipped after sealing (a torn write) in piece/fence record ``n``, or in
    # begin record ``-1 - n`` when negative.
    corrupt_record: int | None = None

    def publish_begin(self, begin: SlotBegin) -> None:
        """Open the slot with ``begin``'s records and ring: a watching receiver starts now."""
        records = begin_records(begin, self.tag)
        if self.corrupt_record is not None and self.corrupt_record < 0:
            records[-1 - self.corrupt_record, 6] ^= np.uint64(1)  # tests: -1 = the begin record
        self.region.publish_many(self.slot, records)
        self.region.count_begin(self.bell)
        self.region.ring(self.bell)

    def claimed_by(self, instance: int) -> bool:
        """Whether the receiver instance the ticket names started this transfer from the
        slot: its BEGIN and SOURCE frames would then tell it nothing."""
        return self.region.claimed(self.slot) == claim_mark(self.tag, instance)

    def publish(self, position: int, record: np.ndarray) -> None:
        """Piece or fence record ``position`` (counted after the begin records)."""
        if position == self.corrupt_record:
            record = record.copy()
            record[6] ^= np.uint64(1)
        self.region.publish(self.slot, self.first + position, record)
        self.region.ring(self.bell)


class SlotTable:
    """The sender's exported slots region and which slots are leased. Any thread."""

    def __init__(self, memory: torch.Tensor, rkey: bytes) -> None:
        self.rkey = rkey
        self.memory = memory  # keeps the region's tensor alive
        self.region = SlotRegion(memory.numpy())
        self._free = list(range(NUM_SLOTS))
        self._lock = threading.Lock()

    @property
    def address(self) -> int:
        return self.region.address

    def lease(self, receiver_address: bytes, transfer_id: int, num_blocks: int,
              corrupt_record: int | None = None) -> SlotLease | None:
        """A free slot (None when all are leased: the transfer announces through frames).
        Receivers get a bell by address hash: a shared bell only costs spurious wake-ups."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        tag = secrets.randbits(64)
        self.region.open(slot, tag, transfer_id)
        bell = xxhash.xxh3_64_intdigest(receiver_address) % NUM_BELLS
        return SlotLease(self.region, slot, tag, bell, num_begin_records(num_blocks),
                         corrupt_record)

    def release(self, lease: SlotLease) -> None:
        """After the transfer was released: its receiver reads the slot no more (and any
        stale read fails its check against the next lease's tag)."""
        with self._lock:
            self._free.append(lease.slot)

    def num_free(self) -> int:
        with self._lock:
            return len(self._free)
