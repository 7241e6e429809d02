"""The process's UCXX runtime: one background thread with its own asyncio loop, the UCX worker,
the control-frame receive loop, endpoints, and payload send/receive/drain primitives.

Sender and receiver roles sit on top of one `HandoffTransport`; only it touches ucxx.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Self, TypeVar

import numpy as np
import torch

from pdserve.engine.threads import name_native_thread
from pdserve.handoff.config import HandoffConfig
from pdserve.handoff.kvcopy import check_contiguous
from pdserve.handoff.liveness import pid_scope
from pdserve.handoff.wire import CONTROL_TAG, MAX_FRAME_BYTES, Kind, WireError, peek

log = logging.getLogger(__name__)
T = TypeVar("T")
CONTROL_RING = 16  # control-frame receives kept posted (64 KiB each)
PROGRESS_WAIT_MS = 100  # the progress thread's epoll wait when nothing happens
FrameHandler = Callable[[Kind, bytes], None]


# What two processes must share to reach each other's memory and loopback: two containers
# (pods) of one machine share its hostname and boot id but none of these.
SHARED_NAMESPACES = ("net", "ipc", "mnt")


def host_identity() -> str:
    """Same string for processes that can share memory and loopback (one machine's boot, one
    network, IPC and mount namespace), different across machines and across containers."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    namespaces = []
    for kind in SHARED_NAMESPACES:
        try:
            namespaces.append(os.readlink(f"/proc/self/ns/{kind}"))
        except OSError:  # no procfs namespaces: the machine is all there is to tell
            namespaces.append(f"{kind}:?")
    return "/".join([socket.gethostname(), boot, *namespaces])


def _ucx_buffer(buffer: torch.Tensor | np.ndarray) -> Any:
    """What ucxx accepts: host memory as numpy (shares storage), CUDA tensors as they are."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("refusing to send a non-contiguous numpy array")
        return buffer
    check_contiguous(buffer)
    return buffer if buffer.is_cuda else buffer.view(torch.uint8).reshape(-1).numpy()


async def _unpinned(operation: Awaitable[T]) -> T:
    """Await a ucxx operation; on failure drop the traceback frames inside ucxx before
    re-raising. ucxx keeps the exception in the request's future, and those frames reference
    its context, which would then outlive ``ucxx.reset()`` at shutdown."""
    try:
        return await operation
    except BaseException as exc:  # noqa: BLE001 - re-raised, only the traceback is dropped
        raise exc.with_traceback(None) from None


class HandoffTransport:
    """Owns the handoff thread. Start once per process (ucxx keeps one context per process),
    never fork after `start` (UCX state is not fork-safe: use multiprocessing "spawn"), and
    `stop` before exit (it stops ucxx's notifier thread, without which exit can hang).

    Thread-safety: `submit` and `call_soon` may be called from any thread; everything else
    documented as "loop only" must run on the handoff loop (inside handlers or submitted
    coroutines). `stop` is idempotent and never hangs longer than its timeout.
    """

    def __init__(self, config: HandoffConfig) -> None:
        self.config = config
        self.host = config.host_id or host_identity()
        self.scope = pid_scope(self.host)
        self.pid = os.getpid()
        self.instance_id = int.from_bytes(os.urandom(8), "little") >> 1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="pdserve-handoff", daemon=True)
        self._payload = concurrent.futures.ThreadPoolExecutor(
            1, "pdserve-handoff-payload", initializer=name_native_thread,
            initargs=("pdserve-payload",))
        self._handlers: dict[Kind, FrameHandler] = {}
        self._shutdown_hooks: list[Callable[[], None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._endpoints: list[Any] = []
        self._address = b""
        self._started = False
        self._stopped = False

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> Self:
        if self._started:
            raise RuntimeError("HandoffTransport already started")
        self._started = True
        self._thread.start()
        self._address = self.submit(self._init_ucx()).result(timeout=60)
        log.info("handoff transport up on %s (instance %x)", self.host, self.instance_id)
        return self

    async def _init_ucx(self) -> bytes:
        import ucxx  # type: ignore[import-untyped]

        if torch.cuda.is_available():
            # CUDA before UCX: the worker may start its transport before its engine, and UCX's
            # CUDA transports and ucxx's progress thread (which makes device 0's context
            # current) must find the primary context torch uses, already made.
            torch.cuda.init()
            torch.cuda.current_stream()
        ucxx.init(options=self.config.ucx_options(), progress_mode="thread",
                  enable_python_future=True)
        # Fill the future pool now; otherwise the first request races ucxx's notifier thread
        # and ucxx logs a warning (ucxx exposes the worker only through its context).
        worker = ucxx.core._get_ctx().worker
        worker.populate_python_futures_pool()
        # ucxx starts its progress thread with a 1 ms epoll timeout: an idle process wakes
        # about a thousand times a second, on the core its engine steps on. Events wake the
        # thread at once whatever the timeout, so a long one only quiets the idle wakeups.
        worker.stop_progress_thread()
        worker.start_progress_thread(polling_mode=False, epoll_timeout=PROGRESS_WAIT_MS)
        self.spawn(self._control_loop())
        return bytes(ucxx.get_worker_address().tobytes())

    def _run_loop(self) -> None:
        name_native_thread(self._thread.name)
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is in flight, close endpoints, stop ucxx's threads, end the loop thread."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        try:
            self.submit(self._shutdown()).result(timeout=timeout)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            log.warning("handoff transport shutdown incomplete: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout)
        self._payload.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self) -> None:
        import ucxx  # type: ignore[import-untyped]

        for hook in self._shutdown_hooks:
            try:
                hook()
            except Exception:  # a failing role must not keep UCX alive
                log.exception("handoff shutdown hook failed")
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for task in tasks:
            # A finished task keeps its exception, whose traceback keeps frames (and through
            # them ucxx's context) alive; fetching it once lets asyncio drop it.
            if task.done():
                with contextlib.suppress(BaseException):
                    task.result()
        self._tasks.clear()
        del tasks
        for endpoint in self._endpoints:
            endpoint.abort()
        self._endpoints.clear()
        # The notifier thread must stop before the process exits or exit can hang (ucxx docs).
        ucxx.stop_notifier_thread()
        try:
            ucxx.reset()
        except Exception as exc:  # noqa: BLE001 - leaked references must never block exit
            log.warning("ucxx.reset() incomplete: %s", str(exc)[:3000])

    # ---- identity and scheduling ------------------------------------------------------
    @property
    def address(self) -> bytes:
        """This worker's UCX address; peers connect with it (it goes into tickets)."""
        return self._address

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Loop only: run ``coro`` as a task that shutdown cancels and awaits."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run_payload(self, fn: Callable[..., T], *args: Any) -> T:
        """Loop only: run CPU-heavy payload work (hash, scatter) off the loop, one at a time."""
        return await self._loop.run_in_executor(self._payload, fn, *args)

    def attach(self, kinds: Iterable[Kind], handler: FrameHandler, tick: Callable[[], None],
               on_shutdown: Callable[[], None]) -> Callable[[], None]:
        """A role joins (any thread): ``handler`` gets its kinds of frames, ``tick`` runs on the
        loop every ``heartbeat_interval_s`` and ``on_shutdown`` at shutdown. Returns the
        detach function, after which none of them runs again."""
        kinds = tuple(kinds)
        self._handlers.update(dict.fromkeys(kinds, handler))
        self._shutdown_hooks.append(on_shutdown)
        ticker = self.submit(self._every(self.config.heartbeat_interval_s, tick))

        def detach() -> None:
            for kind in kinds:
                if self._handlers.get(kind) == handler:
                    del self._handlers[kind]
            if on_shutdown in self._shutdown_hooks:
                self._shutdown_hooks.remove(on_shutdown)
            ticker.cancel()
        return detach

    async def _every(self, interval: float, tick: Callable[[], None]) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # shutdown cancels it with the rest
        task.add_done_callback(self._tasks.discard)
        while True:
            await asyncio.sleep(interval)
            tick()

    # ---- UCX primitives (loop only) ----------------------------------------------------
    async def open_endpoint(self, address: bytes, peer_host: str,
                            on_error: Callable[[], None]) -> Any:
        """An endpoint to a peer worker. Towards this host without UCX error handling (which
        would rule out shared memory); towards other hosts with it, and ``on_error`` runs
        (on the loop) when UCX reports the peer failed."""
        import ucxx  # type: ignore[import-untyped]

        local = peer_host == self.host
        endpoint = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=not local)
        if not local:
            endpoint.set_close_callback(lambda: self._loop.call_soon_threadsafe(on_error))
        self._endpoints.append(endpoint)
        return endpoint

    def close_endpoint(self, endpoint: Any) -> None:
        """Close ``endpoint``; ucxx cancels the receives and sends still posted on it."""
        if endpoint in self._endpoints:
            self._endpoints.remove(endpoint)
            endpoint.abort()

    async def send_frame(self, endpoint: Any, frame: bytes) -> None:
        await _unpinned(endpoint.send(np.frombuffer(frame, dtype=np.uint8), tag=CONTROL_TAG,
                                      force_tag=True))

    async def send_payload(self, endpoint: Any, buffer: torch.Tensor | np.ndarray,
                           tag: int) -> None:
        await _unpinned(endpoint.send(_ucx_buffer(buffer), tag=tag, force_tag=True))

    async def recv_payload(self, endpoint: Any, buffer: torch.Tensor, tag: int) -> None:
        """Receive the message with ``tag`` into ``buffer``, posted on the endpoint to its
        sender, so closing that endpoint cancels the receive. A larger message raises
        ``ucxx.exceptions.UCXMessageTruncatedError`` and lands nowhere."""
        await _unpinned(endpoint.recv(_ucx_buffer(buffer), tag=tag, force_tag=True))

    async def drain(self, endpoint: Any, tag: int) -> None:
        """Consume one message with ``tag`` into a 1-byte buffer: UCX truncates it, the sender's
        send completes, and not a byte of it lands anywhere."""
        import ucxx  # type: ignore[import-untyped]

        sink = np.empty(1, dtype=np.uint8)
        with contextlib.suppress(ucxx.exceptions.UCXMessageTruncatedError):
            await _unpinned(endpoint.recv(sink, tag=tag, force_tag=True))

    async def _control_loop(self) -> None:
        """Keep `CONTROL_RING` receives posted for control frames and handle them in order (UCX
        matches one tag's messages to receives in posting order); several posted at once make
        a burst of headers cost one wake-up instead of one per frame."""
        import ucxx  # type: ignore[import-untyped]

        def post(buffer: np.ndarray) -> tuple[np.ndarray, asyncio.Future[None]]:
            return buffer, asyncio.ensure_future(_unpinned(ucxx.recv(buffer, tag=CONTROL_TAG)))

        ring = deque(post(np.empty(MAX_FRAME_BYTES, dtype=np.uint8)) for _ in range(CONTROL_RING))
        try:
            while True:
                buffer, receive = ring.popleft()
                try:
                    await receive
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a bad frame must not stop listening
                    log.warning("dropped a control frame: %s", exc)
                else:
                    self._dispatch(buffer.data)
                ring.append(post(buffer))
        finally:
            for _, receive in ring:
                receive.cancel()
            if ring:
                await asyncio.wait([r for _, r in ring], timeout=1.0)
            for _, receive in ring:
                if receive.done() and not receive.cancelled():
                    receive.exception()  # retrieved: nothing left to log at exit

    def _dispatch(self, view: memoryview) -> None:
        try:
            kind, _, total = peek(view)
        except WireError as exc:
            log.warning("dropped a control frame: %s", exc)
            return
        handler = self._handlers.get(kind)
        if handler is None:
            log.warning("dropped a %s frame: no handler in this process", kind.name)
            return
        try:
            handler(kind, bytes(view[:total]))
        except Exception:
            log.exception("handoff %s handler failed", kind.name)
