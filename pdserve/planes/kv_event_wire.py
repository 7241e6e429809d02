"""The KV event plane's wire: a worker's block events to each ingress that subscribes, over
an authenticated TCP connection, as MAC'd msgpack frames.

The worker listens; an ingress connects. The handshake and the numbered, MAC'd frames are
`link.py`'s, under labels of its own. Then the worker sends one SNAPSHOT (its instance,
layout fingerprint, hash salt, block size, the event number it includes, every block per
tier) and EVENTS frames ([first event number, [[kind, tier, hash], ...]]) after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve import auth
from pdserve.engine.kv.events import EventKind, KVEvent, KVSnapshot, Tier
from pdserve.planes.link import (
    PlaneError,
    PlaneProtocol,
)

_KINDS = {EventKind.STORED: 0, EventKind.REMOVED: 1}
_KIND_OF = {v: k for k, v in _KINDS.items()}

EVENT_PLANE = PlaneProtocol(
    name="KV event plane", magic=b"PDKE", version=1,
    purpose=auth.Purpose(b"pdserve-kvevents-proof-v1", b"pdserve-kvevents-session-v1"),
    listener="worker", connector="subscriber")


@dataclass(frozen=True)
class WorkerIdentity:
    """What a subscriber needs to read a worker's hashes: who it is this start, what layout
    its KV has, and how it hashes prompt blocks (`engine.block_hash` with this salt)."""

    instance: str
    layout_fingerprint: str
    hash_salt: str
    block_size: int


@dataclass(frozen=True)
class Snapshot:
    identity: WorkerIdentity
    snapshot: KVSnapshot


@dataclass(frozen=True)
class EventBatch:
    first_seq: int
    events: list[tuple[EventKind, Tier, bytes]]


def snapshot_message(identity: WorkerIdentity, snapshot: KVSnapshot) -> list[Any]:
    blocks = {tier.value: hashes for tier, hashes in snapshot.blocks.items()}
    return ["snapshot", identity.instance, identity.layout_fingerprint, identity.hash_salt,
            identity.block_size, snapshot.seq, blocks]


def events_message(events: list[KVEvent]) -> list[Any]:
    return ["events", events[0].seq,
            [[_KINDS[e.kind], e.tier.value, e.block_hash] for e in events]]


def parse_message(message: Any) -> Snapshot | EventBatch:
    """A frame's message as what it says; `PlaneError` when its shape is wrong."""
    try:
        return _parse(message)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise PlaneError(f"KV event plane frame does not parse: {exc}") from exc


def _parse(body: Any) -> Snapshot | EventBatch:
    if body[0] == "snapshot":
        _, instance, layout, salt, block_size, seq, blocks = body
        identity = WorkerIdentity(str(instance), str(layout), str(salt), int(block_size))
        parsed = {Tier(tier): [bytes(h) for h in hashes] for tier, hashes in blocks.items()}
        return Snapshot(identity, KVSnapshot(int(seq), parsed))
    if body[0] == "events":
        _, first, events = body
        return EventBatch(int(first), [(_KIND_OF[int(k)], Tier(t), bytes(h))
                                       for k, t, h in events])
    raise ValueError(f"unknown frame {body[0]!r}")
