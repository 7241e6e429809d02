"""What a worker's KV tiers hold, as events: a full block stored in or removed from a tier,
keyed by the engine's block hash, numbered per worker. The event plane ships them.

Thread-safe: the engine thread records; the event plane snapshots and subscribes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Tier(StrEnum):
    """Where a block's KV lives. DEVICE and HOST are per worker; STORE is the shared pool;
    PEER names KV pulled from another worker (a reuse's source, never an index tier)."""

    DEVICE = "device"
    HOST = "host"
    STORE = "store"
    PEER = "peer"


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class KVEvent:
    """One change to one tier: ``seq`` is this worker's event number (1, 2, ... per start)."""

    seq: int
    kind: EventKind
    tier: Tier
    block_hash: bytes


@dataclass(frozen=True)
class KVSnapshot:
    """Every block each tier held right after event ``seq``."""

    seq: int
    blocks: dict[Tier, list[bytes]]


EventListener = Callable[[KVEvent], None]


class KVEventLog:
    """The worker's numbered events and the state they add up to.

    Contract: `stored` and `removed` are called once per change, in the order the changes
    happened (a tier never reports a block stored twice without a removal between). A
    listener is called under the log's lock, in sequence order, and must only hand the event
    on (never block). `snapshot` and `subscribe` together give a reader a consistent start:
    the snapshot's ``seq`` is the last event it includes, and the listener gets every later one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._blocks: dict[Tier, set[bytes]] = {Tier.DEVICE: set(), Tier.HOST: set()}
        self._listeners: list[EventListener] = []

    @property
    def seq(self) -> int:
        return self._seq

    def stored(self, block_hash: bytes, tier: Tier) -> None:
        self._record(EventKind.STORED, tier, block_hash)

    def removed(self, block_hash: bytes, tier: Tier) -> None:
        self._record(EventKind.REMOVED, tier, block_hash)

    def holds(self, block_hash: bytes, tier: Tier) -> bool:
        with self._lock:
            return block_hash in self._blocks.get(tier, ())

    def count(self, tier: Tier) -> int:
        with self._lock:
            return len(self._blocks.get(tier, ()))

    def snapshot_and_subscribe(self, listener: EventListener) -> KVSnapshot:
        """The state now, and ``listener`` called with every event after it."""
        with self._lock:
            self._listeners.append(listener)
            return KVSnapshot(self._seq, {t: list(b) for t, b in self._blocks.items()})

    def unsubscribe(self, listener: EventListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _record(self, kind: EventKind, tier: Tier, block_hash: bytes) -> None:
        with self._lock:
            held = self._blocks.setdefault(tier, set())
            if kind is EventKind.STORED:
                held.add(block_hash)
            else:
                held.discard(block_hash)
            self._seq += 1
            event = KVEvent(self._seq, kind, tier, block_hash)
            for listener in self._listeners:
                listener(event)
