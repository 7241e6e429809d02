"""The KV event plane's wire: a worker's block events to each ingress that subscribes, over
an authenticated TCP connection, as MAC'd msgpack frames.

The worker listens; an ingress connects. Handshake as the token plane's (the token never
crosses the wire), under labels of its own. Then the worker sends one SNAPSHOT (its instance,
layout fingerprint, hash salt, block size, the event number it includes, every block per
tier) and EVENTS frames ([first event number, [[kind, tier, hash], ...]]) after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve.engine.kv_events import EventKind, KVEvent, KVSnapshot, Tier
from pdserve.handoff import auth

MAGIC = b"PDKE"
VERSION = 1
EVENTS = auth.Purpose(b"pdserve-kvevents-proof-v1", b"pdserve-kvevents-session-v1")
_SUBSCRIBER_PROOF, _WORKER_PROOF, _KEY = 1, 2, 0
_HEADER = struct.Struct("<IQ")  # payload length, frame number
HEADER_BYTES = _HEADER.size + auth.MAC_BYTES
MAX_FRAME_BYTES = 64 * 2**20
HANDSHAKE_TIMEOUT_S = 10.0
_KINDS = {EventKind.STORED: 0, EventKind.REMOVED: 1}
_KIND_OF = {v: k for k, v in _KINDS.items()}


class KVEventPlaneError(Exception):
    """A peer that could not prove itself, or a broken frame."""


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


def _mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    digest = hmac.new(key, header, hashlib.sha256)
    digest.update(payload)
    return digest.digest()[:auth.MAC_BYTES]


class FrameWriter:
    def __init__(self, key: bytes) -> None:
        self._key, self._seq = key, 0

    def _frame(self, body: list[Any]) -> bytes:
        payload = msgpack.packb(body, use_bin_type=True)
        self._seq += 1
        header = _HEADER.pack(len(payload), self._seq)
        return header + _mac(self._key, header, payload) + payload

    def snapshot(self, identity: WorkerIdentity, snapshot: KVSnapshot) -> bytes:
        blocks = {tier.value: hashes for tier, hashes in snapshot.blocks.items()}
        return self._frame(["snapshot", identity.instance, identity.layout_fingerprint,
                            identity.hash_salt, identity.block_size, snapshot.seq, blocks])

    def events(self, events: list[KVEvent]) -> bytes:
        return self._frame(["events", events[0].seq,
                            [[_KINDS[e.kind], e.tier.value, e.block_hash] for e in events]])


class FrameReader:
    """Refuses frames whose MAC, order or shape is wrong."""

    def __init__(self, key: bytes) -> None:
        self._key, self._seq = key, 0

    async def read(self, reader: asyncio.StreamReader) -> Snapshot | EventBatch:
        head = await reader.readexactly(HEADER_BYTES)
        header, tag = head[:_HEADER.size], head[_HEADER.size:]
        length, seq = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise KVEventPlaneError(f"frame of {length} bytes is over {MAX_FRAME_BYTES}")
        payload = await reader.readexactly(length)
        if not hmac.compare_digest(_mac(self._key, header, payload), tag):
            raise KVEventPlaneError("frame MAC does not verify")
        if seq != self._seq + 1:
            raise KVEventPlaneError(f"frame {seq} out of order (expected {self._seq + 1})")
        self._seq = seq
        try:
            return _parse(msgpack.unpackb(payload, raw=False))
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise KVEventPlaneError(f"frame does not parse: {exc}") from exc


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


async def worker_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           token: str) -> bytes:
    """The listening side: challenge, check the subscriber's proof, prove back."""
    nonce = auth.new_nonce()
    writer.write(MAGIC + bytes([VERSION]) + nonce)
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        answer = await reader.readexactly(auth.NONCE_BYTES + 32)
    peer_nonce, peer_proof = answer[:auth.NONCE_BYTES], answer[auth.NONCE_BYTES:]
    if not auth.check_proof(token, _SUBSCRIBER_PROOF, peer_nonce, nonce, peer_proof, EVENTS):
        raise KVEventPlaneError("the subscriber's proof does not verify")
    writer.write(auth.proof(token, _WORKER_PROOF, peer_nonce, nonce, EVENTS))
    await writer.drain()
    return auth.session_key(token, _KEY, peer_nonce, nonce, EVENTS)


async def subscriber_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               token: str) -> bytes:
    """The connecting side: answer the challenge, check the worker's proof."""
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        hello = await reader.readexactly(len(MAGIC) + 1 + auth.NONCE_BYTES)
        if hello[:len(MAGIC)] != MAGIC or hello[len(MAGIC)] != VERSION:
            raise KVEventPlaneError("the peer is not a pdserve KV event plane of this version")
        peer_nonce = hello[len(MAGIC) + 1:]
        nonce = auth.new_nonce()
        writer.write(nonce + auth.proof(token, _SUBSCRIBER_PROOF, nonce, peer_nonce, EVENTS))
        peer_proof = await reader.readexactly(32)
    if not auth.check_proof(token, _WORKER_PROOF, nonce, peer_nonce, peer_proof, EVENTS):
        raise KVEventPlaneError("the worker's proof does not verify")
    return auth.session_key(token, _KEY, nonce, peer_nonce, EVENTS)
