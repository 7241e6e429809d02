"""The token plane end to end in one process over real loopback TCP: a decode replica's
publisher and an ingress's listener. One frame per step fans out to every subscription; a
lagging reader gets its tokens merged; forged, unauthenticated and foreign frames are
refused; either side going away ends the other's requests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pdserve.decode.token_publisher import IngressGoneError, TokenPublisher
from pdserve.engine.engine_outputs import RequestOutput
from pdserve.planes.link import FrameWriter
from pdserve.planes.token_wire import TOKEN_PLANE
from pdserve.router.token_plane import (
    DecodeGoneError,
    InconsistentOutputError,
    TokenPlane,
    TokenSubscription,
)

TOKEN = "cluster-token-0123456789"
BIG = 64 * 2**20


# Per request: output tokens published so far and the last of them (cleared by `run`).
_published: dict[str, tuple[int, int]] = {}


def out(rid: str, ids: list[int], finished: bool = False) -> RequestOutput:
    """The next output of ``rid``, continuing what was published for it before."""
    count, last = _published.get(rid, (0, -1))
    _published[rid] = (count + len(ids), ids[-1] if ids else last)
    return RequestOutput(rid, ids, "".join(f"<{i}>" for i in ids), finished,
                         "length" if finished else None, num_prompt_tokens=4,
                         num_cached_tokens=0, num_output_tokens=count + len(ids),
                         prev_token_id=last)


def subscribe(plane: TokenPlane, rid: str, every_delta: bool = True,
              after: tuple[int, ...] = ()) -> TokenSubscription:
    """A subscription whose client has the output tokens ``after``."""
    sub = plane.subscribe(rid, every_delta=every_delta)
    sub.continue_from(after)
    return sub


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def run(test: Callable[[TokenPlane, TokenPublisher], Awaitable[Any]],
        max_buffered: int = BIG) -> Any:
    async def main() -> Any:
        _published.clear()
        plane = TokenPlane(TOKEN, "127.0.0.1")
        publisher = TokenPublisher(TOKEN, max_buffered)
        try:
            return await test(plane, publisher)
        finally:
            await publisher.aclose()
            await plane.close()

    return asyncio.run(main())


def test_one_frame_per_step_fans_out_to_every_stream() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        subs = {rid: subscribe(plane, rid, True) for rid in ("a", "b", "c")}
        dones = {rid: await publisher.open(rid, sink, report_cached=True) for rid in subs}
        publisher.publish([out("a", [1]), out("b", [2]), out("c", [3])])
        publisher.publish([out("a", [4], finished=True), out("b", [5])])
        await until(lambda: plane.stats.num_frames == 2, "both frames")
        deltas = {rid: await sub.next() for rid, sub in subs.items()}
        assert deltas["a"].token_ids == [1, 4] and deltas["a"].finished
        assert deltas["a"].text == "<1><4>" and deltas["a"].finish_reason == "length"
        assert deltas["b"].token_ids == [2, 5] and not deltas["b"].finished
        assert deltas["c"].token_ids == [3] and not deltas["c"].finished
        assert dones["a"].done() and not dones["b"].done()
        assert plane.stats.num_frames == publisher.stats.num_frames == 2
        assert plane.stats.num_entries == 5

    run(test)


def test_a_lagging_reader_gets_everything_merged_and_a_whole_answer_only_its_end() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        stream = subscribe(plane, "s", True)
        whole = subscribe(plane, "w", False)
        for rid in ("s", "w"):
            await publisher.open(rid, sink, report_cached=False)
        for step in range(1, 6):
            publisher.publish([out("s", [step]), out("w", [step])])
        await until(lambda: plane.stats.num_frames == 5, "five frames")
        merged = await stream.next()
        assert merged.token_ids == [1, 2, 3, 4, 5] and merged.text == "<1><2><3><4><5>"
        waiting = asyncio.ensure_future(whole.next())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # a whole answer wakes only for its end
        publisher.publish([out("w", [6], finished=True)])
        answer = await waiting
        assert answer.token_ids == [1, 2, 3, 4, 5, 6] and answer.finished

    run(test)


def test_entries_for_requests_the_ingress_does_not_stream_are_dropped() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        sub = subscribe(plane, "mine", True)
        await publisher.open("mine", sink, report_cached=False)
        await publisher.open("gone", sink, report_cached=False)  # unsubscribed at the ingress
        publisher.publish([out("gone", [9]), out("mine", [1])])
        assert (await sub.next()).token_ids == [1]
        assert plane.stats.num_unknown_entries == 1

    run(test)


def test_a_request_is_bound_to_the_connection_that_streams_it() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        other = TokenPublisher(TOKEN, BIG)
        sub = subscribe(plane, "r", True)
        await publisher.open("r", sink, report_cached=False)
        await other.open("r", sink, report_cached=False)
        publisher.publish([out("r", [1])])
        assert (await sub.next()).token_ids == [1]
        other.publish([RequestOutput("r", [666], "evil", False, None, 4, 0, 2, prev_token_id=1)])
        publisher.publish([out("r", [2])])
        assert (await sub.next()).token_ids == [2]
        assert plane.stats.num_foreign_entries == 1
        await other.aclose()

    run(test)


def test_a_decode_replica_that_goes_away_ends_its_streams_after_their_tokens() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        sub = subscribe(plane, "r", True)
        await publisher.open("r", sink, report_cached=False)
        publisher.publish([out("r", [1, 2])])
        await until(lambda: plane.stats.num_frames == 1, "the frame")
        await publisher.aclose()  # the connection drops, as when the process dies
        assert (await sub.next()).token_ids == [1, 2]
        with pytest.raises(DecodeGoneError):
            await sub.next()

    run(test)


def test_an_ingress_that_goes_away_ends_the_requests_streaming_to_it() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        subscribe(plane, "r", True)
        done = await publisher.open("r", sink, report_cached=False)
        await plane.close()
        with pytest.raises(IngressGoneError):
            await asyncio.wait_for(done, 10)

    run(test)


def test_an_ingress_that_stops_reading_ends_its_requests_not_the_engine() -> None:
    async def test(_plane: TokenPlane, publisher: TokenPublisher) -> None:
        # An ingress that proves itself and then never reads a byte.
        from pdserve.planes.token_wire import TOKEN_PLANE, TokenSink

        stalled: list[asyncio.StreamWriter] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await TOKEN_PLANE.accept(reader, writer, TOKEN)
            stalled.append(writer)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        sink = TokenSink("127.0.0.1", server.sockets[0].getsockname()[1], "stalled")
        done = await publisher.open("r", sink, report_cached=False)
        for _ in range(64):  # 64 MiB of text: far beyond the kernel's socket buffers
            publisher.publish([RequestOutput("r", [1], "x" * 2**20, False, None, 1, 0, 1)])
            await asyncio.sleep(0)
            if done.done():
                break
        with pytest.raises(IngressGoneError, match="unread"):
            await done
        server.close()

    run(test, max_buffered=4 * 2**20)


def test_unauthenticated_and_forged_connections_are_refused() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        # No proof at all: garbage where the answer to the challenge belongs.
        reader, writer = await asyncio.open_connection(sink.host, sink.port)
        writer.write(b"GET / HTTP/1.1\r\n" * 8)
        writer.close()
        await until(lambda: plane.stats.num_refused_connections == 1, "the refusal")
        # The wrong token.
        reader, writer = await asyncio.open_connection(sink.host, sink.port)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await TOKEN_PLANE.connect(reader, writer, "not-the-cluster-token-42")
        writer.close()
        await until(lambda: plane.stats.num_refused_connections == 2, "the second refusal")
        # The right token, then a frame signed with another key: the connection is dropped
        # and the request bound to it ends.
        sub = subscribe(plane, "r", True)
        reader, writer = await asyncio.open_connection(sink.host, sink.port)
        key = await TOKEN_PLANE.connect(reader, writer, TOKEN)
        writer.write(FrameWriter(key).frame([["r", [1], "a", None, 1, 0, None, None, -1]]))
        forged = [["r", [666], "evil", None, 2, 0, None, None, 1]]
        writer.write(FrameWriter(bytes(32)).frame(forged))
        await until(lambda: plane.stats.num_broken_connections == 1, "the dropped connection")
        assert (await sub.next()).token_ids == [1]
        with pytest.raises(DecodeGoneError):
            await sub.next()
        writer.close()

    run(test)


def test_tokens_that_do_not_continue_the_clients_are_never_read() -> None:
    """A recompute's subscription fed a stale entry of the attempt before it (the decode
    worker had not yet stopped it): the reader gets an error, not text; counted."""
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        stale = subscribe(plane, "stale", after=())  # a fresh recompute: the client has none
        await publisher.open("stale", sink, report_cached=False)
        publisher.publish([RequestOutput("stale", [17], "x", False, None, 4, 0,
                                         num_output_tokens=16, prev_token_id=3)])
        with pytest.raises(InconsistentOutputError, match="did not continue"):
            await stale.next()
        # The first token came from prefill (42); decode continues from another one (7).
        other = subscribe(plane, "other", after=(42,))
        await publisher.open("other", sink, report_cached=False)
        publisher.publish([RequestOutput("other", [5], "y", True, "stop", 4, 0,
                                         num_output_tokens=2, prev_token_id=7)])
        await until(lambda: other.num_pending == 1, "the entry")
        with pytest.raises(InconsistentOutputError):
            await other.next()
        assert not other.finished  # its call is cancelled, not waited for
        # Continuing the client's first token is read as usual.
        good = subscribe(plane, "good", after=(42,))
        await publisher.open("good", sink, report_cached=False)
        publisher.publish([RequestOutput("good", [5], "y", False, None, 4, 0,
                                         num_output_tokens=2, prev_token_id=42)])
        assert (await good.next()).token_ids == [5]
        assert plane.stats.num_inconsistent_generations == 2

    run(test)


def test_resumed_tokens_set_where_a_recompute_continues() -> None:
    async def test(plane: TokenPlane, publisher: TokenPublisher) -> None:
        sink = await plane.sink()
        sub = subscribe(plane, "r", after=(8, 9))
        await publisher.open("r", sink, report_cached=False)
        publisher.publish([RequestOutput("r", [10, 11], "z", False, None, 4, 0,
                                         num_output_tokens=4, prev_token_id=9)])
        assert (await sub.next()).token_ids == [10, 11]
        assert (sub.num_tokens, sub.last_token_id) == (4, 11)

    run(test)
