"""The ingress end of the token plane: a listener decode replicas connect to, and one
subscription per generation that the frames' entries fan out to.

A frame is read and decoded once and its entries go to their requests' subscriptions, where
they merge until the request's reader takes them: a reader that lags holds nobody else up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.tiers.cost import KVReuse
from pdserve.planes.link import FrameReader, PlaneError
from pdserve.planes.token_wire import (
    TOKEN_PLANE,
    TokenEntry,
    TokenSink,
    decode_logprobs,
    parse_entries,
)
from pdserve.router.delta import GenerationDelta
from pdserve.router.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)


class DecodeGoneError(ServiceUnavailableError):
    """The decode replica streaming a request's tokens went away mid-generation."""

    def __init__(self) -> None:
        super().__init__("the decode worker serving this request stopped; retry it",
                         kind="decode_gone")


def retry_id(request_id: str) -> str:
    """The workers' and the token plane's id for a generation's recompute on decode: the
    first attempt's request may run on the decode worker until its cancel lands, and its
    tokens must find no reader."""
    return f"{request_id}.retry"


class InconsistentOutputError(ServiceUnavailableError):
    """Tokens for a request that do not continue the ones its client has (another attempt's,
    or from a worker whose KV came from elsewhere): the request stops before they become
    text."""

    def __init__(self, request_id: str, detail: str) -> None:
        super().__init__("the worker's output for this request did not continue the tokens "
                         "already returned, so it was stopped; retry it",
                         kind="inconsistent_output")
        self.request_id = request_id
        self.detail = detail


@dataclass
class TokenPlaneStats:
    num_connections: int = 0
    num_refused_connections: int = 0  # failed the handshake: no token, or another protocol
    num_broken_connections: int = 0  # a bad MAC, an out-of-order or malformed frame
    num_frames: int = 0
    num_entries: int = 0
    num_unknown_entries: int = 0  # for a request this ingress is not streaming (any more)
    num_foreign_entries: int = 0  # for a request another connection streams
    num_inconsistent_generations: int = 0  # stopped: an entry did not continue their tokens


class TokenSubscription:
    """One generation's tokens as they arrive. ``every_delta``: the reader wakes for each
    arrival (a stream); otherwise only for the last one or an error (a whole answer)."""

    __slots__ = ("request_id", "every_delta", "connection", "last_taken_at", "finished",
                 "num_tokens", "last_token_id", "on_inconsistent", "_entries", "_waiter",
                 "_error")

    def __init__(self, request_id: str, every_delta: bool,
                 on_inconsistent: Callable[[InconsistentOutputError], None] | None = None
                 ) -> None:
        self.request_id = request_id
        self.every_delta = every_delta
        self.connection: int | None = None  # bound to the first connection that sends for it
        self.last_taken_at = time.monotonic()
        self.finished = False
        # The output tokens the client has (None: not known yet) and the last of them (-1:
        # none): every entry read must continue exactly these (`continue_from`).
        self.num_tokens: int | None = None
        self.last_token_id = -1
        self.on_inconsistent = on_inconsistent
        self._entries: list[TokenEntry] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    def continue_from(self, token_ids: list[int] | tuple[int, ...]) -> None:
        """The output tokens the client has before this subscription's first entry."""
        self.num_tokens = len(token_ids)
        self.last_token_id = token_ids[-1] if token_ids else -1

    def push(self, entry: TokenEntry) -> None:
        self._entries.append(entry)
        if entry.finish_reason is not None:
            self.finished = True
        if self._waiter is not None and (self.every_delta or self.finished):
            self._wake()

    def fail(self, exc: BaseException) -> None:
        """End the subscription with ``exc`` (raised once the entries before it are read)."""
        if self._error is None and not self.finished:
            self._error = exc
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def num_pending(self) -> int:
        return len(self._entries)

    def pending_bytes(self) -> int:
        """About how many bytes the entries waiting for the reader hold (counted on demand:
        the stall watch asks only of subscriptions whose reader lags)."""
        return sum(entry_bytes(entry) for entry in self._entries)

    async def next(self) -> GenerationDelta:
        """Everything that arrived since the last call, merged, once there is something (the
        last delta has ``finished``); a failure is raised after what arrived before it."""
        while not (self._entries and (self.every_delta or self.finished)):
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        entries, self._entries = self._entries, []
        self.last_taken_at = time.monotonic()
        self._check(entries)
        return merge_entries(entries)

    def _check(self, entries: list[TokenEntry]) -> None:
        """Each entry continues the tokens before it: its count starts where they end and
        it names their last token; anything else never becomes text."""
        if self.num_tokens is None:
            raise RuntimeError("continue_from() must come before the first entry is read")
        for entry in entries:
            tokens, num_after, prev = entry.token_ids, entry.num_output_tokens, entry.prev_token_id
            start = num_after - len(tokens)
            if start != self.num_tokens or (tokens and start > 0 and prev != self.last_token_id):
                detail = (f"an entry of tokens {start}..{num_after} after token {prev} where "
                          f"the client has {self.num_tokens} ending in {self.last_token_id}")
                error = InconsistentOutputError(self.request_id, detail)
                self._error, self.finished = error, False
                if self.on_inconsistent is not None:
                    self.on_inconsistent(error)
                raise error
            self.num_tokens = num_after
            if tokens:
                self.last_token_id = tokens[-1]


# Per entry, per token and per logprob (a token's or an alternative's): what they take on the
# wire, as an estimate of what a stream's unsent output holds.
_ENTRY_BYTES, _TOKEN_BYTES, _LOGPROB_BYTES = 32, 8, 16


def entry_bytes(entry: TokenEntry) -> int:
    size = _ENTRY_BYTES + len(entry.text.encode()) + _TOKEN_BYTES * len(entry.token_ids)
    for _, _, top in entry.logprobs or ():
        size += _LOGPROB_BYTES * (1 + len(top))
    return size


def merge_entries(entries: list[TokenEntry]) -> GenerationDelta:
    """Consecutive entries of one request as one delta: tokens, text and logprobs in order,
    the last one's finish."""
    last = entries[-1]
    reuse = next((KVReuse.from_wire(e.kv_reuse) for e in entries if e.kv_reuse is not None),
                 None)
    finished = last.finish_reason is not None
    if len(entries) == 1:
        return GenerationDelta(last.text, last.token_ids, finished, last.finish_reason,
                               last.num_cached_tokens, decode_logprobs(last.logprobs), reuse)
    return GenerationDelta(
        "".join(e.text for e in entries), [t for e in entries for t in e.token_ids],
        finished, last.finish_reason, max(e.num_cached_tokens for e in entries),
        [lp for e in entries for lp in decode_logprobs(e.logprobs)], reuse)


class TokenPlane:
    """Listens on ``host`` (an OS-chosen port) for decode replicas holding ``token``."""

    def __init__(self, token: str, host: str,
                 on_inconsistent: Callable[[InconsistentOutputError], None] | None = None
                 ) -> None:
        """``on_inconsistent``: told of each generation stopped because an entry did not
        continue its tokens (the ingress counts them in its metrics)."""
        self._on_inconsistent = on_inconsistent
        self._token = token
        self._host = host
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()
        self._sink: TokenSink | None = None
        self._subs: dict[str, TokenSubscription] = {}
        self._bound: dict[int, set[str]] = {}  # connection -> requests it streams
        self._writers: set[asyncio.StreamWriter] = set()
        self._ids = itertools.count(1)
        self.stats = TokenPlaneStats()

    async def sink(self) -> TokenSink:
        """This plane's address for decode replicas (listening from the first call on)."""
        if self._sink is None:
            async with self._starting:
                if self._sink is None:
                    self._server = await asyncio.start_server(self._serve, self._host, 0)
                    port = self._server.sockets[0].getsockname()[1]
                    self._sink = TokenSink(self._host, port, secrets.token_hex(8))
                    logger.info("token plane listening on %s:%d", self._host, port)
        return self._sink

    def subscribe(self, request_id: str, every_delta: bool) -> TokenSubscription:
        """Before the request is sent anywhere: its first entries may arrive at once."""
        if request_id in self._subs:
            raise RuntimeError(f"request {request_id!r} already streams on this ingress")
        sub = TokenSubscription(request_id, every_delta, self._inconsistent)
        self._subs[request_id] = sub
        return sub

    def _inconsistent(self, error: InconsistentOutputError) -> None:
        self.stats.num_inconsistent_generations += 1
        logger.error("stopped %s: the decode worker's tokens did not continue the ones its "
                     "client has (%s)", error.request_id, error.detail)
        if self._on_inconsistent is not None:
            self._on_inconsistent(error)

    def unsubscribe(self, request_id: str) -> None:
        sub = self._subs.pop(request_id, None)
        if sub is not None and sub.connection is not None:
            self._bound.get(sub.connection, set()).discard(request_id)

    def subscriptions(self) -> list[TokenSubscription]:
        return list(self._subs.values())

    def subscription(self, request_id: str) -> TokenSubscription | None:
        """The generation's subscription, its recompute's (`retry_id`) once it has one."""
        return self._subs.get(retry_id(request_id)) or self._subs.get(request_id)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            try:
                key = await TOKEN_PLANE.accept(reader, writer, self._token)
            except (PlaneError, asyncio.IncompleteReadError, TimeoutError,
                    ConnectionError) as exc:
                self.stats.num_refused_connections += 1
                logger.warning("token plane refused a connection from %s: %s",
                               writer.get_extra_info("peername"), exc)
                return
            self.stats.num_connections += 1
            connection = next(self._ids)
            self._bound[connection] = set()
            try:
                await self._read(connection, reader, FrameReader(key, TOKEN_PLANE))
            finally:
                cut = [self._subs[rid] for rid in self._bound.pop(connection)
                       if rid in self._subs and not self._subs[rid].finished]
                if cut:
                    logger.warning("a decode replica (%s) dropped its token-plane connection "
                                   "with generations open (%d): they end with an error",
                                   writer.get_extra_info("peername"), len(cut))
                for sub in cut:
                    sub.fail(DecodeGoneError())
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _read(self, connection: int, reader: asyncio.StreamReader,
                    frames: FrameReader) -> None:
        try:
            while True:
                self._dispatch(connection, parse_entries(await frames.read(reader)))
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the decode replica closed or died
        except PlaneError as exc:
            self.stats.num_broken_connections += 1
            logger.warning("token plane dropped a connection: %s", exc)

    def _dispatch(self, connection: int, entries: list[TokenEntry]) -> None:
        stats = self.stats
        stats.num_frames += 1
        stats.num_entries += len(entries)
        subs, bound = self._subs, self._bound[connection]
        for entry in entries:
            sub = subs.get(entry.request_id)
            if sub is None:
                stats.num_unknown_entries += 1
                continue
            if sub.connection != connection:
                if sub.connection is not None:
                    stats.num_foreign_entries += 1
                    continue
                sub.connection = connection
                bound.add(entry[0])
            sub.push(entry)

