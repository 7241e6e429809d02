"""One coroutine a router object keeps running on the event loop (a poll, a sweep): started
on demand and again after it ended, cancelled and awaited on stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    def __init__(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._run = run
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run on the running loop unless already running (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
