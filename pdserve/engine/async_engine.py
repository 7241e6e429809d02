"""Runs an `LLMEngine` on its own thread and streams outputs to asyncio callers.

Workers talk to the engine only through this: every engine call happens on the engine
thread, between steps, so the engine itself needs no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from pdserve.engine.cpu_lending import CoreLending
from pdserve.engine.engine import LayerHook, LLMEngine
from pdserve.engine.engine_outputs import RequestOutput
from pdserve.engine.errors import EngineDeadError
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.threads import name_native_thread

logger = logging.getLogger(__name__)
T = TypeVar("T")


class StepSink(Protocol):
    """Takes a whole step's outputs at once, on the engine thread (the token plane's
    publisher): it must only hand them on, never block."""

    def put_step(self, outputs: list[RequestOutput]) -> None: ...

    def fail_all(self, exc: BaseException) -> None: ...


class _Stream:
    """One request's outputs on their way from the engine thread to its event loop. A reader
    takes everything that arrived since it last looked."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Event-loop thread only (the engine thread goes through `call_soon_threadsafe`)."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[RequestOutput | BaseException]:
        """Everything queued, once something is."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class AsyncEngine:
    """Owns the engine thread. Thread-safe; awaitable from any event loop."""

    def __init__(self, engine: LLMEngine, layer_hook: LayerHook | None = None,
                 step_sink: StepSink | None = None, cores: CoreLending | None = None) -> None:
        """``step_sink`` gets each step's outputs of requests without a stream of their own
        (`open_stream`), all in one call; ``cores``: the worker lends its cores while idle
        and runs steps on other idle workers' cores too."""
        self.engine = engine
        self.layer_hook = layer_hook
        self.step_sink = step_sink
        self.cores = cores
        if cores is not None:
            engine.step_cores = cores.step
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue())
        self._streams: dict[str, _Stream] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._error: BaseException | None = None
        engine.tiers.wakeup = self._wakeup.set  # a finished copy wakes an idle loop
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
        """Add a request and yield its outputs until it finishes (what arrived while the
        caller was busy as one merged output); cancelling aborts it."""
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
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        return stream

    async def stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """A request's outputs as they come; what arrived while the caller was busy comes
        as one merged output."""
        while True:
            items = await stream.take()
            outputs = [i for i in items if not isinstance(i, BaseException)]
            if outputs:
                merged = outputs[0] if len(outputs) == 1 else merge_outputs(outputs)
                yield merged
                if merged.finished:
                    return
            errors = [i for i in items if isinstance(i, BaseException)]
            if errors:
                raise errors[0]

    async def close_stream(self, request_id: str, abort: bool) -> None:
        """Forget the stream; with `abort`, stop the request and free its blocks (the caller
        went away before it finished)."""
        self._streams.pop(request_id, None)
        if abort and self._error is None:
            await self.call(lambda: self.engine.abort(request_id))

    @property
    def lent_steps(self) -> int:
        """Steps that ran with other workers' idle cores (0 without lending)."""
        return 0 if self.cores is None else self.cores.lent_steps

    @property
    def is_dead(self) -> bool:
        return self._error is not None

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.close()
        if self.cores is not None and not self._thread.is_alive():
            self.cores.close()

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        name_native_thread(self._thread.name)
        try:
            while not self._stopping:
                self._drain_commands()
                if self.engine.has_schedulable_requests():
                    self._dispatch(self._step())
                else:
                    if self.cores is not None:
                        self.cores.idle()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        except BaseException as exc:
            logger.exception("engine thread crashed")
            self._error = exc
            self._fail_everything(exc)

    def _step(self) -> list[RequestOutput]:
        if self.cores is not None:
            self.cores.busy()
        return self.engine.step(self.layer_hook)

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
        rest = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.put, out)
            else:
                rest.append(out)
        if rest and self.step_sink is not None:
            self.step_sink.put_step(rest)

    def _fail_everything(self, exc: BaseException) -> None:
        dead = EngineDeadError(f"engine thread died: {exc!r}")
        for stream in list(self._streams.values()):
            stream.loop.call_soon_threadsafe(stream.put, dead)
        if self.step_sink is not None:
            self.step_sink.fail_all(dead)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(dead)


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: their tokens, text and logprobs in order,
    the last one's state (finished, counts)."""
    return dataclasses.replace(
        outputs[-1],
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outputs),
        logprobs=[lp for o in outputs for lp in o.logprobs],
    )
