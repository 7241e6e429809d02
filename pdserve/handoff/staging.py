"""A bounded pool of reusable contiguous byte buffers (host or CUDA) for pieces in flight, and
the first-come-first-served queue in which receivers wait for them.

Reuse matters: a fresh host buffer page-faults on first touch, which costs as much as the copy.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MIN_CLASS = 64 * 1024
# Size classes per power of two: a buffer is at most 1/8 larger than asked (a power-of-two class
# doubles a piece just above one), and pieces of nearly the same size still share a class.
_CLASSES_PER_OCTAVE = 8


@dataclass(frozen=True)
class StagingStats:
    capacity_bytes: int
    in_use_bytes: int
    cached_bytes: int
    num_acquired: int
    num_refused: int
    num_quarantined: int


class StagingPool:
    """Hands out uint8 buffers of size classes (eight per power of two, none above the capacity),
    never more than ``capacity_bytes`` in use plus cached. Thread-safe. ``try_acquire`` never
    blocks: callers that find it full queue in a `StagingAdmission` (on the handoff loop) until
    a release makes room.

    CUDA: UCX writes and reads staging outside any stream's order, while PyTorch's caching
    allocator may hand out memory that kernels queued earlier on the allocating stream still
    use. So new CUDA buffers are allocated on the pool's own stream, which runs no kernels: the
    allocator reuses a block only on the stream that freed it, so a new buffer is either fresh
    memory or an evicted staging buffer, and waiting for that idle stream is all the ordering it
    needs. (A device-wide synchronize there would hold the engine thread, in a layer hook, behind
    every kernel queued on the device.) Released buffers are done with (sends completed,
    scatters waited for), so reused and evicted ones need no sync.

    Ownership: a buffer belongs to its acquirer until ``release``; the pool never hands the
    same buffer to two holders and never frees one that is in use.
    """

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cpu") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means this one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._in_use: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (class size, buffer)
        self._quarantined: list[torch.Tensor] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._in_use_bytes = 0
        self._cached_bytes = 0
        self._num_acquired = 0
        self._num_refused = 0

    def size_class(self, nbytes: int) -> int:
        """The buffer size that serves ``nbytes``: the next of eight steps per power of two,
        capped at the capacity for a piece that fits it."""
        if nbytes <= _MIN_CLASS:
            return _MIN_CLASS
        step = (1 << (nbytes - 1).bit_length()) // (2 * _CLASSES_PER_OCTAVE)
        size = -(-nbytes // step) * step
        return min(size, self.capacity_bytes) if nbytes <= self.capacity_bytes else size

    def fits_ever(self, nbytes: int) -> bool:
        return self.size_class(nbytes) <= self.capacity_bytes

    def try_acquire(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of at least ``nbytes`` bytes, or None when the bound would be exceeded."""
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                buffer = free.pop()
                self._cached_bytes -= size
            else:
                if self._in_use_bytes + size > self.capacity_bytes:
                    self._num_refused += 1
                    return None
                total = self._in_use_bytes + self._cached_bytes + size
                self._evict_locked(total - self.capacity_bytes)
                buffer = None
            self._in_use_bytes += size
            self._num_acquired += 1
        if buffer is None:
            # Allocate outside the lock: page faults or a CUDA malloc can take a while.
            buffer = self._allocate(size)
        with self._lock:
            self._in_use[id(buffer)] = (size, buffer)
        return buffer

    def _allocate(self, size: int) -> torch.Tensor:
        if self._stream is None:
            return torch.empty(size, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(self._stream):
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._stream.synchronize()
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            entry = self._in_use.pop(id(buffer), None)
            if entry is None:
                raise ValueError("releasing a staging buffer this pool did not hand out")
            size = entry[0]
            self._in_use_bytes -= size
            self._free.setdefault(size, []).append(buffer)
            self._cached_bytes += size

    def quarantine(self, buffer: torch.Tensor) -> None:
        """Retire a buffer whose UCX request was cancelled: UCX may still write into (or read
        from) it, so it is never reused nor freed while the pool lives; its bytes stop
        counting against the bound."""
        with self._lock:
            entry = self._in_use.pop(id(buffer), None)
            if entry is None:
                raise ValueError("quarantining a staging buffer this pool did not hand out")
            size = entry[0]
            self._in_use_bytes -= size
            self._quarantined.append(buffer)

    def _evict_locked(self, excess: int) -> None:
        for size in sorted(self._free, reverse=True):
            bucket = self._free[size]
            while bucket and excess > 0:
                bucket.pop()
                self._cached_bytes -= size
                excess -= size
            if excess <= 0:
                return

    def stats(self) -> StagingStats:
        with self._lock:
            return StagingStats(
                self.capacity_bytes, self._in_use_bytes, self._cached_bytes,
                self._num_acquired, self._num_refused, len(self._quarantined),
            )

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with the buffers held."""
        with self._lock:
            in_use = sum(size for size, _ in self._in_use.values())
            cached = sum(size * len(bucket) for size, bucket in self._free.items())
        if in_use != self._in_use_bytes or cached != self._cached_bytes:
            raise AssertionError(
                f"staging pool accounting off: in use {in_use} vs {self._in_use_bytes}, "
                f"cached {cached} vs {self._cached_bytes}"
            )


_Waiter = tuple[int, Callable[[], bool], "asyncio.Future[torch.Tensor | None]"]


class StagingAdmission:
    """Grants a pool's buffers in arrival order; a waiter whose transfer ended gets None.
    Loop only. A piece whose header was accepted waits here until the pool can hold it; its
    sender's rendezvous send stays pending meanwhile (UCX moves nothing before a receive)."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self._waiting: deque[_Waiter] = deque()

    async def acquire(self, nbytes: int, abandoned: Callable[[], bool]) -> torch.Tensor | None:
        """A buffer for ``nbytes``, or None once ``abandoned()`` turns true while waiting."""
        if not self._waiting:
            buffer = self.pool.try_acquire(nbytes)
            if buffer is not None:
                return buffer
        future: asyncio.Future[torch.Tensor | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((nbytes, abandoned, future))
        try:
            return await future
        except asyncio.CancelledError:
            granted = future.result() if future.done() and not future.cancelled() else None
            if granted is not None:
                self.pool.release(granted)  # granted just as we were cancelled
            raise

    def release(self, buffer: torch.Tensor) -> None:
        self.pool.release(buffer)
        self.pump()

    def pump(self) -> None:
        """Hand freed space to waiters in order; call after a release or when a transfer ends."""
        while self._waiting:
            nbytes, abandoned, future = self._waiting[0]
            if future.done() or abandoned():
                self._waiting.popleft()
                if not future.done():
                    future.set_result(None)
                continue
            buffer = self.pool.try_acquire(nbytes)
            if buffer is None:
                return
            self._waiting.popleft()
            future.set_result(buffer)
