"""The decode end of the token plane: one authenticated connection per ingress replica, and
per engine step one frame to each ingress with live streams here, carrying all their tokens.

The engine thread hands each step's outputs over in one call; grouping, encoding and writing
happen on the replica's event loop, which never waits on a slow ingress (see `Route.send`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.engine_outputs import RequestOutput
from pdserve.planes.link import FrameWriter, PlaneAuthError, PlaneError
from pdserve.planes.token_wire import TOKEN_PLANE, TokenEntry, TokenSink, encode_logprobs

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


class IngressGoneError(RuntimeError):
    """The ingress replica a request streams to is gone (or stopped reading): the request
    stops and frees its blocks."""


@dataclass
class PublisherStats:
    num_steps: int = 0  # engine steps that produced output for some stream here
    num_frames: int = 0
    num_entries: int = 0
    num_connections: int = 0  # opened, in all
    num_routes_failed: int = 0


class Route:
    """One connection to one ingress replica and the requests streaming over it."""

    def __init__(self, sink: TokenSink, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, key: bytes, max_buffered_bytes: int) -> None:
        self.sink = sink
        self.reader, self.writer = reader, writer
        self.frames = FrameWriter(key)
        self.max_buffered_bytes = max_buffered_bytes
        self.requests: dict[str, _Stream] = {}
        self.error: BaseException | None = None

    def send(self, entries: list[TokenEntry]) -> None:
        """Queue one frame. The transport buffers what the ingress has not read yet; past
        ``max_buffered_bytes`` the ingress counts as stuck and its streams stop, so a lagging
        ingress never holds the engine or other ingresses."""
        if self.error is not None:
            return
        self.writer.write(self.frames.frame(entries))
        if self.writer.transport.get_write_buffer_size() > self.max_buffered_bytes:
            self.fail(IngressGoneError(
                f"the ingress at {self.sink.host}:{self.sink.port} left over "
                f"{self.max_buffered_bytes} bytes of tokens unread"))

    def fail(self, exc: BaseException) -> None:
        """End every stream of this route with ``exc`` and drop the connection."""
        if self.error is not None:
            return
        self.error = exc
        for stream in list(self.requests.values()):
            stream.fail(exc)
        self.writer.transport.abort()

    async def watch(self) -> None:
        """The ingress sends nothing after the handshake: EOF or any byte ends the route."""
        try:
            data = await self.reader.read(1)
            reason = "closed the token plane" if not data else "sent bytes it must not"
        except (ConnectionError, OSError) as exc:
            reason = f"dropped the token plane ({exc})"
        self.fail(IngressGoneError(f"the ingress at {self.sink.host}:{self.sink.port} "
                                   f"{reason}"))


@dataclass
class _Stream:
    """A request streaming its tokens over a route; ``done`` resolves when its last entry
    was written (or fails with why it cannot be)."""

    route: Route
    done: asyncio.Future[None]
    report_cached: bool  # this worker prefilled the prompt: its cache hits saved compute

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
            self.done.exception()  # whoever awaits it still gets it; nobody else must


class TokenPublisher:
    """Owns this decode replica's token-plane connections and the requests on them."""

    def __init__(self, token: str, max_buffered_bytes: int) -> None:
        self._token = token
        self._max_buffered_bytes = max_buffered_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[TokenSink, Route] = {}
        self._connecting: dict[TokenSink, asyncio.Task[Route]] = {}
        self._streams: dict[str, _Stream] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self.stats = PublisherStats()

    # ---- the event loop's side ----------------------------------------------------------
    async def open(self, request_id: str, sink: TokenSink,
                   report_cached: bool) -> asyncio.Future[None]:
        """Start streaming ``request_id``'s outputs to ``sink`` (connecting once per ingress);
        returns the future its last entry resolves."""
        self._loop = asyncio.get_running_loop()
        route = await self._route(sink)
        stream = _Stream(route, self._loop.create_future(), report_cached)
        self._streams[request_id] = stream
        route.requests[request_id] = stream
        return stream.done

    def close(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.route.requests.pop(request_id, None)
            if not stream.done.done():
                stream.done.cancel()

    def publish(self, outputs: Sequence[RequestOutput]) -> None:
        """One step's outputs: one frame per ingress that has any of them."""
        by_route: dict[Route, list[TokenEntry]] = {}
        finished: list[_Stream] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_route.setdefault(stream.route, []).append(TokenEntry(
                out.request_id, out.new_token_ids, out.new_text,
                (out.finish_reason or "stop") if out.finished else None,
                out.num_output_tokens, out.num_cached_tokens if stream.report_cached else 0,
                encode_logprobs(out.logprobs),
                out.kv_reuse.to_wire() if stream.report_cached and out.kv_reuse else None,
                out.prev_token_id))
            if out.finished:
                finished.append(stream)
        if not by_route:
            return
        self.stats.num_steps += 1
        for route, entries in by_route.items():
            route.send(entries)
            self.stats.num_frames += 1
            self.stats.num_entries += len(entries)
        for stream in finished:
            if not stream.done.done():
                stream.done.set_result(None)

    async def aclose(self) -> None:
        for route in list(self._routes.values()):
            route.fail(IngressGoneError("the decode replica is stopping"))
        for task in list(self._watchers):
            task.cancel()

    # ---- the engine thread's side ----------------------------------------------------------
    def put_step(self, outputs: list[RequestOutput]) -> None:
        """Engine thread: hand one step's outputs to the event loop (one wake-up a step)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.publish, outputs)

    def fail_all(self, exc: BaseException) -> None:
        """Engine thread: the engine died; every stream ends with ``exc``."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_streams, exc)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.fail(exc)

    # ---- connections --------------------------------------------------------------------
    async def _route(self, sink: TokenSink) -> Route:
        route = self._routes.get(sink)
        if route is not None and route.error is None:
            return route
        task = self._connecting.get(sink)
        if task is None:
            task = asyncio.ensure_future(self._connect(sink))
            self._connecting[sink] = task
            task.add_done_callback(lambda _: self._connecting.pop(sink, None))
        return await asyncio.shield(task)

    async def _connect(self, sink: TokenSink) -> Route:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(sink.host, sink.port)
        except (OSError, TimeoutError) as exc:
            raise PlaneError(f"cannot reach the ingress's token plane at {sink.host}:"
                             f"{sink.port}: {exc}") from exc
        try:
            key = await TOKEN_PLANE.connect(reader, writer, self._token)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            writer.transport.abort()
            raise PlaneAuthError(f"the token plane at {sink.host}:{sink.port} refused "
                                 f"this replica's proof or closed: {exc!r}") from exc
        except BaseException:
            writer.transport.abort()
            raise
        route = Route(sink, reader, writer, key, self._max_buffered_bytes)
        self._routes[sink] = route
        self.stats.num_connections += 1
        watcher = asyncio.ensure_future(self._watch(route))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        logger.info("token plane connected to the ingress at %s:%d", sink.host, sink.port)
        return route

    async def _watch(self, route: Route) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await route.watch()
        if self._routes.get(route.sink) is route:
            del self._routes[route.sink]
        self.stats.num_routes_failed += 1
        logger.warning("token plane to %s:%d ended: %s", route.sink.host, route.sink.port,
                       route.error)
