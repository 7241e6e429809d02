"""Read slots: how a same-host sender announces the pieces a receiver reads itself (and the
fence) through shared memory, instead of a UCX frame per piece through both event loops.

The sender exports one region of ``REGION_BYTES``: ``NUM_BELLS`` bell words (a u32 per 64-byte
line) then ``NUM_SLOTS`` slots. A read transfer leases a slot; a slot is a header line (u32
count of published records, then the lease's tag) and ``SLOT_RECORDS`` records of eight
little-endian u64. The compute thread writes record ``n`` (a piece's bounds and digest, or
the fence), then sets the count to ``n + 1``, then bumps its receiver's bell and wakes it
(futex). The eighth word of a record is a check, xxh3-64 of the other seven seeded with the
lease's random tag, so a reader never acts on a record that is torn, stale, from another use
of the slot, or not yet visible (weakly ordered CPUs); the receiver checks a valid record
exactly like a PIECE or FENCE frame.
"""

from __future__ import annotations

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
MAX_SLOT_PIECES = SLOT_RECORDS - 1  # the last record holds the fence
KIND_PIECE, KIND_FENCE = 1, 2
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
        self._records = slots[:, LINE_BYTES:].view("<u8").reshape(NUM_SLOTS, SLOT_RECORDS,
                                                                  _WORDS)

    def published(self, slot: int) -> int:
        return min(int(self._counts[slot, 0]), SLOT_RECORDS)

    def record(self, slot: int, position: int) -> np.ndarray:
        return self._records[slot, position].copy()

    def publish(self, slot: int, position: int, record: np.ndarray) -> None:
        self._records[slot, position] = record
        self._counts[slot, 0] = position + 1  # after the record: x86 keeps stores in order

    def reset(self, slot: int) -> None:
        self._counts[slot, 0] = 0

    def bell(self, bell: int) -> int:
        return int(self._bells[bell * _U32_PER_LINE])

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
    corrupt_record: int | None = None  # tests: a bit flipped after sealing (a torn write)

    def publish(self, position: int, record: np.ndarray) -> None:
        if position == self.corrupt_record:
            record = record.copy()
            record[6] ^= np.uint64(1)
        self.region.publish(self.slot, position, record)
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

    def lease(self, receiver_address: bytes,
              corrupt_record: int | None = None) -> SlotLease | None:
        """A free slot (None when all are leased: the transfer announces through frames).
        Receivers get a bell by address hash: a shared bell only costs spurious wake-ups."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
        self.region.reset(slot)
        bell = xxhash.xxh3_64_intdigest(receiver_address) % NUM_BELLS
        return SlotLease(self.region, slot, secrets.randbits(64), bell, corrupt_record)

    def release(self, lease: SlotLease) -> None:
        """After the transfer was released: its receiver reads the slot no more (and any
        stale read fails its check against the next lease's tag)."""
        with self._lock:
            self._free.append(lease.slot)

    def num_free(self) -> int:
        with self._lock:
            return len(self._free)
