"""Streams whose client stopped reading are ended, so that they give back what they hold.

A client that stops reading leaves the server's send blocked (flow control: the socket's
buffers are full); the stream's body then stops taking its tokens, which merge and pile up in
its `TokenSubscription`. `StallWatch` sees a send blocked for too long, or too much output
piled up behind one, and ends the stream: it cancels the task sending the response, whose own
cleanup ends the generations (freeing their admission slots and KV blocks), recorded as
``stalled``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from starlette.types import Message, Receive, Scope, Send

from pdserve.router.background import BackgroundTask
from pdserve.router.sse import EventStreamResponse

logger = logging.getLogger(__name__)

# The watch looks this many times per timeout (and at least once a second): a send blocked
# for the timeout is ended at most two looks later.
_CHECKS_PER_TIMEOUT = 4


@dataclass(frozen=True)
class StallSettings:
    """http.stalled_stream_timeout_s and http.max_unsent_stream_bytes (the schema checks
    them)."""

    timeout_s: float
    max_unsent_bytes: int


class PendingTokens(Protocol):
    """What the watch reads of a request's token subscription."""

    def pending_bytes(self) -> int: ...


class WatchedStream:
    """One streamed response as the watch sees it: the generations feeding it, the task
    sending it, what to do before that task is cancelled, and its sends (``num_sends`` is
    odd while one is in progress; the watch notes when it first saw that one)."""

    __slots__ = ("request_ids", "on_stall", "task", "num_sends", "_seen", "_seen_at")

    def __init__(self, request_ids: Sequence[str], on_stall: Callable[[], None]) -> None:
        self.request_ids = tuple(request_ids)
        self.on_stall = on_stall
        self.task: asyncio.Task[object] | None = None
        self.num_sends = 0
        self._seen, self._seen_at = 0, 0.0

    def blocked_for(self, now: float) -> float | None:
        """How long the send in progress has been seen blocked (None: none in progress)."""
        if self.num_sends % 2 == 0:
            return None
        if self._seen != self.num_sends:
            self._seen, self._seen_at = self.num_sends, now
        return now - self._seen_at


class StallWatch:
    """Finds and ends stalled streams (`sweep`), every timeout / 4 once `start`ed."""

    def __init__(self, subscription: Callable[[str], PendingTokens | None],
                 settings: StallSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._subscription = subscription
        self.settings = settings
        self._clock = clock
        self._streams: set[WatchedStream] = set()
        self._background = BackgroundTask(self._run)
        self.num_stalled = 0

    def add(self, stream: WatchedStream) -> None:
        self._streams.add(stream)

    def discard(self, stream: WatchedStream) -> None:
        self._streams.discard(stream)

    def why_stalled(self, stream: WatchedStream) -> str | None:
        """Why the stream counts as stalled now, or None while its client keeps up. A send
        blocks only while the client's and the server's socket buffers are full."""
        blocked_s = stream.blocked_for(self._clock())
        if blocked_s is None:
            return None
        if blocked_s > self.settings.timeout_s:
            return f"its client took none of its output for {blocked_s:.1f} s"
        subs = [self._subscription(request_id) for request_id in stream.request_ids]
        unsent = sum(sub.pending_bytes() for sub in subs if sub is not None)
        if unsent > self.settings.max_unsent_bytes:
            return f"{unsent} bytes of its output waited for its client"
        return None

    def sweep(self) -> int:
        """End every stalled stream: its ``on_stall``, then its task cancelled. Returns how
        many were ended."""
        ended = 0
        for stream in list(self._streams):
            why = self.why_stalled(stream)
            if why is None or stream.task is None:
                continue
            self._streams.discard(stream)
            logger.info("ending stream %s: %s (http.stalled_stream_timeout_s, "
                        "http.max_unsent_stream_bytes)", stream.request_ids[0], why)
            stream.on_stall()
            stream.task.cancel()
            ended += 1
        self.num_stalled += ended
        return ended

    def start(self) -> None:
        """Sweep in the background on the running loop (idempotent)."""
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()

    async def _run(self) -> None:
        period_s = min(1.0, self.settings.timeout_s / _CHECKS_PER_TIMEOUT)
        while True:
            await asyncio.sleep(period_s)
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad sweep
                logger.exception("stall watch sweep failed")


class WatchedEventStream(EventStreamResponse):
    """An SSE response that `StallWatch` watches while its body is sent: if it stalls, the
    task sending it (the one running this response) is cancelled, which unblocks the send
    the client left hanging and runs the response's cleanup."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]],
                 watch: StallWatch, stream: WatchedStream) -> None:
        super().__init__(events, on_close)
        self._watch, self._stream = watch, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = self._stream
        stream.task = asyncio.current_task()

        async def counted_send(message: Message) -> None:
            stream.num_sends += 1  # odd: a send in progress
            await send(message)
            stream.num_sends += 1

        self._watch.add(stream)
        self._watch.start()
        try:
            await super().__call__(scope, receive, counted_send)
        finally:
            self._watch.discard(stream)
