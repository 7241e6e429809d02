"""Awaiting work unless something else happens first: a client leaving, a role dying.

The work is cancelled (and its cancellation awaited) when the other event wins.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Overtaken(Exception):
    """``stop`` happened before the work finished; the work was cancelled."""


async def unless(work: Awaitable[T], stop: Awaitable[object]) -> T:
    """``work``'s result (or its exception), unless ``stop`` completes first: then the work
    is cancelled and `Overtaken` raised."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop)
    try:
        await asyncio.wait((task, stopper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise Overtaken
    return task.result()
