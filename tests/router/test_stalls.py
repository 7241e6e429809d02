"""Stalled streams: which the watch ends (a send blocked too long, too much output behind
one), and that ending one unblocks a real server's send to a client that stopped reading and
runs the response's cleanup.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from pdserve.router.stalls import StallSettings, StallWatch, WatchedEventStream, WatchedStream
from tests.support import raw_http
from tests.support.processes import free_port
from tests.support.waiting import wait_for

SETTINGS = StallSettings(timeout_s=2.0, max_unsent_bytes=1000)


@dataclass
class Sub:
    """A token subscription as the watch reads it."""

    unsent: int = 0

    def pending_bytes(self) -> int:
        return self.unsent


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch_of(subs: dict[str, Sub], clock: Clock) -> StallWatch:
    return StallWatch(subs.get, SETTINGS, clock)


def test_a_stream_stalls_once_one_send_stays_blocked_past_the_timeout() -> None:
    clock, subs = Clock(), {"a": Sub(), "b": Sub()}
    watch = watch_of(subs, clock)
    stream = WatchedStream(["a", "b"], lambda: None)
    watch.add(stream)
    assert watch.why_stalled(stream) is None  # no send in progress: waiting for tokens is fine
    stream.num_sends = 1  # a send starts (first seen now, at 100)
    assert watch.why_stalled(stream) is None
    clock.now = 101.5
    stream.num_sends = 3  # it finished and the next one blocks: the client reads, slowly
    assert watch.why_stalled(stream) is None
    clock.now = 103.4
    assert watch.why_stalled(stream) is None
    clock.now = 103.6
    assert "took none of its output for 2.1 s" in str(watch.why_stalled(stream))
    stream.num_sends = 4  # the send went through after all
    assert watch.why_stalled(stream) is None


def test_unsent_output_past_the_cap_stalls_a_blocked_stream_at_once() -> None:
    clock, subs = Clock(), {"a": Sub(unsent=600), "b": Sub(unsent=401)}
    watch = watch_of(subs, clock)
    stream = WatchedStream(["a", "b", "gone"], lambda: None)
    watch.add(stream)
    assert watch.why_stalled(stream) is None  # not blocked: the body takes it all next
    stream.num_sends = 1
    assert "1001 bytes" in str(watch.why_stalled(stream))
    subs["b"].unsent = 400
    assert watch.why_stalled(stream) is None


def test_sweep_runs_on_stall_then_cancels_the_sending_task_once() -> None:
    async def run() -> None:
        clock, subs = Clock(), {"a": Sub()}
        watch = watch_of(subs, clock)
        order: list[str] = []
        task = asyncio.ensure_future(asyncio.Event().wait())
        stalled = WatchedStream(["a"], lambda: order.append(f"on_stall {task.cancelling()}"))
        stalled.task, stalled.num_sends = task, 1
        fine = WatchedStream(["a"], lambda: order.append("wrong"))
        fine.task = asyncio.ensure_future(asyncio.sleep(10))
        for stream in (stalled, fine):
            watch.add(stream)
        assert watch.sweep() == 0
        clock.now = 103.0
        assert watch.sweep() == 1 and watch.sweep() == 0
        await asyncio.gather(task, return_exceptions=True)
        assert order == ["on_stall 0"] and task.cancelled() and watch.num_stalled == 1
        assert not fine.task.done()
        fine.task.cancel()

    asyncio.run(run())


@dataclass
class Served:
    url: str
    closed: threading.Event


@pytest.fixture
def stalling_server() -> Iterator[Served]:
    """A real uvicorn server whose one route streams 4 KiB events for ever, watched by a
    StallWatch with a timeout of 0.5 s."""
    closed = threading.Event()
    watch = StallWatch({}.get, StallSettings(0.5, 1 << 30))

    async def endless() -> AsyncIterator[str]:
        while True:
            yield "data: " + "x" * 4096 + "\n\n"
            await asyncio.sleep(0)

    async def on_close() -> None:
        closed.set()

    async def route(request: Request) -> WatchedEventStream:
        return WatchedEventStream(endless(), on_close, watch, WatchedStream(["r"], lambda: None))

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/s", route)]),
                                           host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "uvicorn to start")
    try:
        yield Served(f"http://127.0.0.1:{port}", closed)
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_client_that_stops_reading_is_cut_loose_and_the_stream_cleaned_up(
        stalling_server: Served) -> None:
    sock = raw_http.open_unread(stalling_server.url, "/s", None)
    try:
        # The server's send blocks once the buffers fill; the watch then cancels the task
        # sending the response, which runs the response's on_close.
        wait_for(stalling_server.closed.is_set, 10, "the stalled stream to be closed")
    finally:
        sock.close()
