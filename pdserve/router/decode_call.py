"""One decode worker `generate` call and its request's token subscription, as one object:
the call carries the request's lifecycle (ticket, KV outcome, end), the subscription its tokens.

The request ends when both have: its last tokens arrived on the token plane and the call
ended, so the lifecycle events a request produced are all counted in its trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.decode.api import DecodeEvent, DecodeRequest, HandoffFailed, KVArrived
from pdserve.planes.link import PlaneError
from pdserve.router.delta import GenerationDelta
from pdserve.router.timings import RequestTrace
from pdserve.router.token_plane import TokenPlane

# How long the two halves of a finished request may trail each other: the call's end after
# the last tokens, or the last tokens after the call's end (they normally come together).
TRAIL_S = 5.0


class HandoffFailedSignal(Exception):
    """The decode worker reported that the prompt's KV never arrived intact."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class DecodeCall:
    """Subscribes, then calls (the first tokens may arrive at once); `close` ends both."""

    def __init__(self, decode: Any, plane: TokenPlane, request: DecodeRequest,
                 trace: RequestTrace, stream: bool) -> None:
        self.plane = plane
        self.trace = trace
        self.request_id = request.request_id
        self.sub = plane.subscribe(request.request_id, every_delta=stream)
        if request.local_prefill:  # else the prefill's first token, once it is known
            self.sub.continue_from(request.resume_output_ids)
        self.call = decode.options(stream=True).generate.remote(request)
        self._follower: asyncio.Task[None] | None = None

    async def next_event(self) -> DecodeEvent:
        """The call's next lifecycle event, awaited here (before `follow`)."""
        event: DecodeEvent = await self.call.__anext__()
        self._count_message()
        return event

    def follow(self, prefill_done: float | None = None) -> None:
        """Read the rest of the call's events in the background: the KV's outcome, and a
        failure of the call, which ends the subscription with it."""
        self._follower = asyncio.ensure_future(self._follow(prefill_done))

    async def deltas(self) -> AsyncIterator[GenerationDelta]:
        """The request's tokens until its last; the call's failure or a failed handoff
        (`HandoffFailedSignal`) is raised after whatever arrived before it."""
        while True:
            delta = await self.sub.next()
            yield delta
            if delta.finished:
                return

    async def close(self) -> None:
        """A finished request waits (bounded) for its call to end, so its trace is whole;
        any other ends its call at once, which stops the request on the worker."""
        self.plane.unsubscribe(self.request_id)
        follower = self._follower
        if self.sub.finished and follower is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(follower), TRAIL_S)
        if follower is not None and not follower.done():
            follower.cancel()
        if not (follower is not None and follower.done() and self.sub.finished):
            self.call.cancel()

    def _count_message(self) -> None:
        self.trace.update(num_serve_messages=self.trace.timings.num_serve_messages + 1)

    async def _follow(self, prefill_done: float | None) -> None:
        try:
            async for event in self.call:
                self._count_message()
                if isinstance(event, HandoffFailed):
                    self.sub.fail(HandoffFailedSignal(event.code or "other"))
                elif isinstance(event, KVArrived) and prefill_done is not None:
                    self.trace.update(
                        handoff_ms=event.handoff_wait_s * 1000.0,
                        handoff_bytes=event.handoff_bytes,
                        handoff_exposed_ms=(time.monotonic() - prefill_done) * 1000.0)
        except Exception as exc:  # noqa: BLE001 - the reader raises it
            self.sub.fail(exc)
            return
        # The call ended with its request: the last tokens are on their way over the plane,
        # which reports its own failures; this only bounds a request that lost them anyway.
        asyncio.get_running_loop().call_later(TRAIL_S, self.sub.fail, PlaneError(
            "the decode worker ended the request without its last tokens"))
