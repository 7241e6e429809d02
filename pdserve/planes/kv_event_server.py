"""A worker's end of the KV event plane: serves its event log to every ingress that
subscribes, on a thread and event loop of its own, so the engine thread only appends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from concurrent.futures import Future

from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.events import KVEvent, KVEventLog
from pdserve.engine.threads import name_native_thread
from pdserve.planes.kv_event_wire import (
    EVENT_PLANE,
    WorkerIdentity,
    events_message,
    snapshot_message,
)
from pdserve.planes.link import FrameWriter, PlaneError

logger = logging.getLogger(__name__)

# What one subscriber may leave unread before the worker drops it (it reconnects and gets a
# fresh snapshot): far above a few seconds of events.
MAX_UNREAD_BYTES = 16 * 2**20


class _Subscriber:
    """One connection's pending events: appended on the engine thread (under the log's
    lock), written on the server's loop in one frame per wake-up."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter,
                 frames: FrameWriter) -> None:
        self.loop, self.writer, self.frames = loop, writer, frames
        self._pending: list[KVEvent] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def on_event(self, event: KVEvent) -> None:
        with self._lock:
            self._pending.append(event)
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        with self._lock:
            events, self._pending, self._scheduled = self._pending, [], False
        if not events or self.writer.is_closing():
            return
        self.writer.write(self.frames.frame(events_message(events)))
        if self.writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            logger.warning("a KV event subscriber fell %d bytes behind; dropped (it "
                           "resyncs)", MAX_UNREAD_BYTES)
            self.writer.transport.abort()


class KVEventServer:
    """Listens on ``host`` (an OS-chosen port) for ingresses holding ``token``; each gets a
    snapshot of ``log`` and every event after it. Nothing here blocks the engine thread."""

    def __init__(self, log: KVEventLog, identity: WorkerIdentity, token: str,
                 host: str) -> None:
        self.log, self.identity, self._token, self._host = log, identity, token, host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-kvevents", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.num_refused = 0  # connections that failed the handshake

    def start(self) -> KVEventServer:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        logger.info("KV event plane listening on %s:%d", self._host, self.port)
        return self

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    @property
    def num_subscribers(self) -> int:
        return len(self._writers)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        done: Future[None] = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        with contextlib.suppress(Exception):
            done.result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        name_native_thread(self._thread.name)
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._serve, self._host, 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            key = await EVENT_PLANE.accept(reader, writer, self._token)
        except (PlaneError, asyncio.IncompleteReadError, TimeoutError,
                ConnectionError) as exc:
            self.num_refused += 1
            logger.warning("KV event plane refused %s: %s", writer.get_extra_info("peername"),
                           exc)
            writer.transport.abort()
            return
        frames = FrameWriter(key)
        subscriber = _Subscriber(asyncio.get_running_loop(), writer, frames)
        self._writers.add(writer)
        # Snapshot and subscription are one step under the log's lock: no event falls
        # between them, and the snapshot frame leaves before any event frame.
        snapshot = self.log.snapshot_and_subscribe(subscriber.on_event)
        try:
            writer.write(frames.frame(snapshot_message(self.identity, snapshot)))
            await reader.read()  # subscribers send nothing more: wait for their EOF
        except ConnectionError:
            pass
        finally:
            self.log.unsubscribe(subscriber.on_event)
            self._writers.discard(writer)
            writer.transport.abort()


def serve_engine_events(engine: LLMEngine, token: str, host: str) -> KVEventServer:
    """Start serving ``engine``'s KV events (its layout, hash salt and block size)."""
    identity = WorkerIdentity(instance=secrets.token_hex(8),
                              layout_fingerprint=engine.layout.fingerprint,
                              hash_salt=engine.kv_manager.salt,
                              block_size=engine.layout.block_size)
    return KVEventServer(engine.tiers.events, identity, token, host).start()
