"""The peer tier: a prefix another worker of the role caches, pulled into this worker's device
blocks over the KV handoff instead of computed; hints in, pulls out, their endings back.

Engine side only: the worker supplies the pull (whom to ask, over which plane).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

# (request id, the prompt's tokens through the last pulled block, the first pulled block,
# the device blocks to fill); the worker reports the end through `PeerTier.finish`, once
# nothing writes those blocks any more.
PeerPull = Callable[[str, list[int], int, list[int]], None]


@dataclass(frozen=True)
class PeerDone:
    """How one pull ended: ``error`` None when its fence verified, else the reason (an
    identifier: peer_gone, peer_miss, timeout, digest, cancelled, ...)."""

    request_id: str
    error: str | None
    num_bytes: int
    seconds: float


class PeerTier:
    """Which requests another worker could serve a longer prefix to, and the pulls' endings.

    Hints are set and read on the engine thread; `finish` may come from any thread and wakes
    the engine, whose `KVTiers.service` settles it.
    """

    def __init__(self, pull: PeerPull, notify: Callable[[], None]) -> None:
        self.pull = pull
        self._notify = notify
        self._hints: dict[str, int] = {}
        self._lock = threading.Lock()
        self._done: list[PeerDone] = []

    def hint(self, request_id: str, num_blocks: int) -> None:
        """Another worker holds the request's first ``num_blocks`` prompt blocks."""
        if num_blocks > 0:
            self._hints[request_id] = num_blocks

    def forget(self, request_id: str) -> None:
        self._hints.pop(request_id, None)

    @property
    def num_hints(self) -> int:
        return len(self._hints)

    def blocks_held(self, request_id: str) -> int:
        return self._hints.get(request_id, 0)

    def finish(self, request_id: str, error: str | None, num_bytes: int, seconds: float) -> None:
        """Any thread: the pull ended and no write into its device blocks is left."""
        with self._lock:
            self._done.append(PeerDone(request_id, error, num_bytes, seconds))
        self._notify()

    @property
    def has_finished(self) -> bool:
        with self._lock:
            return bool(self._done)

    def poll(self) -> list[PeerDone]:
        with self._lock:
            done, self._done = self._done, []
        return done
