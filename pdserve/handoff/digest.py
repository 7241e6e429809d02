"""Piece digests, computed where the piece lives: xxh3-64 of host bytes, and for CUDA pieces a
reduction on the device (no copy of the piece to host). Sender and receiver use the same one.

Device digest: the piece's bytes as unsigned words w_i (32-bit when the size allows), reduced
modulo the prime p = 2^31 - 1 into three sums, Σ w_i, Σ i·w_i and Σ i²·w_i (i from 1), which
are mixed with the byte count by xxh3 on the host (32 bytes cross, not the piece). A flipped
bit changes Σ w_i by ±2^k, never 0 mod p; swapping two different blocks changes the
position-weighted sums; a zeroed or truncated piece changes the sums or the count.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xxhash

if TYPE_CHECKING:
    from pdserve.handoff.plan import PieceSpec

HOST_DIGEST = "xxh3-64"
DEVICE_DIGEST = "modp31x3"
_PRIME = (1 << 31) - 1
# Words reduced per kernel launch: bounds the int64 temporaries (8 bytes a word, a few of them).
_CHUNK_WORDS = 1 << 22
_PIECE_RECORD = struct.Struct("<9Q")


def digest_kind(device: torch.device) -> str:
    return DEVICE_DIGEST if device.type == "cuda" else HOST_DIGEST


def digest(buffer: torch.Tensor) -> int:
    """The digest of a contiguous tensor's bytes, of the kind its device uses."""
    if buffer.is_cuda:
        return device_digest(buffer)
    return xxhash.xxh3_64_intdigest(buffer.reshape(-1).view(torch.uint8).numpy().data)


def device_digest(buffer: torch.Tensor) -> int:
    """The modular-sum digest (module docstring) of a contiguous tensor, on its own device
    (CUDA, or CPU in tests). Reads the piece in place; only three sums come back."""
    flat = buffer.reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    word, mask = ((torch.int32, 0xFFFFFFFF) if nbytes % 4 == 0 else
                  (torch.int16, 0xFFFF) if nbytes % 2 == 0 else (torch.uint8, 0xFF))
    words = flat.view(word)
    totals = torch.zeros(3, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = (words[start:start + _CHUNK_WORDS].to(torch.int64) & mask) % _PRIME
        position = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64,
                                device=flat.device)
        weighted = chunk * position % _PRIME
        squared = chunk * (position * position % _PRIME) % _PRIME
        totals += torch.stack((chunk.sum(), weighted.sum(), squared.sum())) % _PRIME
    sums = _read_back(totals % _PRIME)
    return xxhash.xxh3_64_intdigest(struct.pack("<4Q", *sums, nbytes))


def _read_back(values: torch.Tensor) -> list[int]:
    """A small device tensor's values, through pinned memory and an event on the current
    stream: waits for that stream's work only, not the whole device."""
    if not values.is_cuda:
        return values.tolist()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))
    copied.synchronize()
    return host.tolist()


def combine_digests(records: Sequence[tuple[PieceSpec, int, int]]) -> int:
    """Fence digest over every piece's (bounds, byte count, payload digest), in index order."""
    hasher = xxhash.xxh3_64()
    for spec, nbytes, piece_digest in sorted(records, key=lambda r: r[0].index):
        hasher.update(_PIECE_RECORD.pack(
            spec.index, spec.layer_start, spec.layer_end, spec.kv_start, spec.kv_end,
            spec.block_start, spec.block_end, nbytes, piece_digest))
    return hasher.intdigest()
