"""First-come-first-served waiting for receiver staging space. Loop only.

A piece whose header was accepted waits here until the pool can hold it; its sender's
rendezvous send simply stays pending meanwhile (UCX moves nothing before a buffer is posted).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import torch

from pdserve.handoff.staging import StagingPool

_Waiter = tuple[int, Callable[[], bool], "asyncio.Future[torch.Tensor | None]"]


class StagingAdmission:
    """Grants staging buffers in arrival order; a waiter whose transfer ended gets None."""

    def __init__(self, pool: StagingPool) -> None:
        self._pool = pool
        self._waiting: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    async def acquire(self, nbytes: int, abandoned: Callable[[], bool]) -> torch.Tensor | None:
        """A buffer for ``nbytes``, or None once ``abandoned()`` turns true while waiting."""
        if not self._waiting:
            buffer = self._pool.try_acquire(nbytes)
            if buffer is not None:
                return buffer
        future: asyncio.Future[torch.Tensor | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((nbytes, abandoned, future))
        try:
            return await future
        except asyncio.CancelledError:
            granted = future.result() if future.done() and not future.cancelled() else None
            if granted is not None:
                self._pool.release(granted)  # granted just as we were cancelled
            raise

    def release(self, buffer: torch.Tensor) -> None:
        self._pool.release(buffer)
        self.pump()

    def pump(self) -> None:
        """Hand freed space to waiters in order; call after a release or when a transfer ends."""
        while self._waiting:
            nbytes, abandoned, future = self._waiting[0]
            if future.done():
                self._waiting.popleft()
                continue
            if abandoned():
                self._waiting.popleft()
                future.set_result(None)
                continue
            buffer = self._pool.try_acquire(nbytes)
            if buffer is None:
                return
            self._waiting.popleft()
            future.set_result(buffer)
