"""A KV tier's worker thread: runs the tier's jobs in order off the engine thread, and keeps
what they produced until the engine thread polls for it.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from pdserve.engine.threads import name_native_thread

J = TypeVar("J")
D = TypeVar("D")


class JobThread(Generic[J, D]):
    """``run`` turns each submitted job into its result on this thread (it must not raise:
    a failure is part of the result); ``notify`` is called after each one."""

    def __init__(self, name: str, run: Callable[[J], D],
                 notify: Callable[[], None] | None = None) -> None:
        self._run_job, self._notify = run, notify
        self._jobs: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self._done: deque[D] = deque()
        self.finished = threading.Event()  # set when a job ends; the poller clears it
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: J) -> None:
        self._jobs.put(job)

    def poll(self) -> list[D]:
        """Results since the last poll, in order (engine thread)."""
        self.finished.clear()
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    @property
    def has_finished(self) -> bool:
        return bool(self._done)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        name_native_thread(self._thread.name)
        while (job := self._jobs.get()) is not None:
            self._done.append(self._run_job(job))
            self.finished.set()
            if self._notify is not None:
                self._notify()
