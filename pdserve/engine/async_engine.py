"""Runs an `LLMEngine` on its own thread and streams outputs to asyncio callers.

Workers talk to the engine only through this: every engine call happens on the engine
thread, between steps, so the engine itself needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.engine.engine import LayerHook, LLMEngine, RequestOutput
from pdserve.engine.errors import EngineError
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(EngineError):
    """The engine thread crashed; the worker must be restarted."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Owns the engine thread. Thread-safe; awaitable from any event loop."""

    def __init__(self, engine: LLMEngine, layer_hook: LayerHook | None = None) -> None:
        self.engine = engine
        self.layer_hook = layer_hook
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue())
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # ---- calls into the engine thread -------------------------------------------------
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the engine thread between steps; its result or error lands in the future."""
        future: Future[T] = Future()
        if self._error is not None:
            future.set_exception(EngineDeadError(f"engine thread died: {self._error!r}"))
            return future
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        mode: RequestMode = RequestMode.FULL,
        resume_output_ids: Sequence[int] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes; cancelling aborts it."""
        stream = self.open_stream(request_id)
        finished = False
        try:
            await self.call(lambda: self.engine.add_request(
                request_id, prompt_token_ids, params, mode, resume_output_ids))
            async for out in self.stream(request_id, stream):
                finished = out.finished
                yield out
        finally:
            await self.close_stream(request_id, abort=not finished)

    def open_stream(self, request_id: str) -> _Stream:
        """Register for a request's outputs before it can produce any."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        return stream

    async def stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        while True:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def close_stream(self, request_id: str, abort: bool) -> None:
        """Forget the stream; with `abort`, stop the request and free its blocks (the caller
        went away before it finished)."""
        self._streams.pop(request_id, None)
        if abort and self._error is None:
            await self.call(lambda: self.engine.abort(request_id))

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if self.engine.has_schedulable_requests():
                    self._dispatch(self.engine.step(self.layer_hook))
                else:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        except BaseException as exc:
            logger.exception("engine thread crashed")
            self._error = exc
            self._fail_everything(exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail_everything(self, exc: BaseException) -> None:
        dead = EngineDeadError(f"engine thread died: {exc!r}")
        for stream in list(self._streams.values()):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, dead)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(dead)
