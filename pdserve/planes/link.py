"""What the TCP planes beside the KV handoff share (the token plane, the KV event plane): a
challenge-response handshake on the cluster's token, then numbered frames MAC'd under the key.

The listening side sends MAGIC, version and a nonce; the connecting side answers its own nonce
and a proof over both; the listener checks it and answers its own proof, so each side knows the
other holds the token, which never crosses the wire. A frame is its payload's length and
sequence number, a MAC over both and the payload, then the payload: one msgpack message
(each plane's wire module names its messages' fields and checks their shape).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve import auth

_CONNECTOR_PROOF, _LISTENER_PROOF, _KEY = 1, 2, 0  # session ids: one proof per direction
_HEADER = struct.Struct("<IQ")  # payload length, sequence number
HEADER_BYTES = _HEADER.size + auth.MAC_BYTES
MAX_FRAME_BYTES = 64 * 2**20  # far above any plane's frame; bounds what a reader allocates
HANDSHAKE_TIMEOUT_S = 10.0
_PROOF_BYTES = 32


class PlaneError(Exception):
    """A TCP plane failed: a frame too long, out of order or not a message of the plane, or
    a peer that cannot be reached."""


class PlaneAuthError(PlaneError):
    """The peer does not hold the cluster's token (or speaks another protocol or version),
    or a frame's MAC does not verify."""


@dataclass(frozen=True)
class PlaneProtocol:
    """One plane's identity on the wire and the names its errors use."""

    name: str  # "token plane"
    magic: bytes
    version: int
    purpose: auth.Purpose
    listener: str  # who listens, as errors name it
    connector: str

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     token: str) -> bytes:
        """The listening side's handshake (`listener_handshake`); the session key."""
        return await listener_handshake(reader, writer, token, self)

    async def connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      token: str) -> bytes:
        """The connecting side's handshake (`connector_handshake`); the session key."""
        return await connector_handshake(reader, writer, token, self)


async def listener_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             token: str, proto: PlaneProtocol) -> bytes:
    """The listening side: challenge, check the connector's proof, prove back. Returns the
    session key."""
    nonce = auth.new_nonce()
    writer.write(proto.magic + bytes([proto.version]) + nonce)
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        answer = await reader.readexactly(auth.NONCE_BYTES + _PROOF_BYTES)
    peer_nonce, peer_proof = answer[:auth.NONCE_BYTES], answer[auth.NONCE_BYTES:]
    if not auth.check_proof(token, _CONNECTOR_PROOF, peer_nonce, nonce, peer_proof,
                            proto.purpose):
        raise PlaneAuthError(f"the {proto.connector}'s proof does not verify: it lacks the "
                             "cluster token")
    writer.write(auth.proof(token, _LISTENER_PROOF, peer_nonce, nonce, proto.purpose))
    await writer.drain()
    return auth.session_key(token, _KEY, peer_nonce, nonce, proto.purpose)


async def connector_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                              token: str, proto: PlaneProtocol) -> bytes:
    """The connecting side: answer the challenge, check the listener's proof. Returns the
    session key."""
    magic = proto.magic
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        hello = await reader.readexactly(len(magic) + 1 + auth.NONCE_BYTES)
        if hello[:len(magic)] != magic or hello[len(magic)] != proto.version:
            raise PlaneAuthError(f"the peer is not a pdserve {proto.name} of this version")
        peer_nonce = hello[len(magic) + 1:]
        nonce = auth.new_nonce()
        writer.write(nonce + auth.proof(token, _CONNECTOR_PROOF, nonce, peer_nonce,
                                        proto.purpose))
        peer_proof = await reader.readexactly(_PROOF_BYTES)
    if not auth.check_proof(token, _LISTENER_PROOF, nonce, peer_nonce, peer_proof,
                            proto.purpose):
        raise PlaneAuthError(f"the {proto.listener}'s proof does not verify: it lacks the "
                             "cluster token")
    return auth.session_key(token, _KEY, nonce, peer_nonce, proto.purpose)


def _mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    digest = hmac.new(key, header, hashlib.sha256)
    digest.update(payload)
    return digest.digest()[:auth.MAC_BYTES]


class FrameWriter:
    """Frames one connection's messages: msgpack, a sequence number and a MAC."""

    def __init__(self, key: bytes) -> None:
        self._key, self._seq = key, 0
        self._packer = msgpack.Packer(use_bin_type=True)

    def frame(self, message: Any) -> bytes:
        payload = self._packer.pack(message)
        self._seq += 1
        header = _HEADER.pack(len(payload), self._seq)
        return header + _mac(self._key, header, payload) + payload


class FrameReader:
    """Reads one connection's messages, refusing any whose length, MAC, order or encoding
    is wrong (the plane's wire module then checks the message's shape)."""

    def __init__(self, key: bytes, proto: PlaneProtocol) -> None:
        self._key, self._proto, self._seq = key, proto, 0

    async def read(self, reader: asyncio.StreamReader) -> Any:
        """The next frame's message (IncompleteReadError when the peer closed)."""
        head = await reader.readexactly(HEADER_BYTES)
        header, tag = head[:_HEADER.size], head[_HEADER.size:]
        length, seq = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise PlaneError(f"{self._proto.name} frame of {length} bytes is over "
                             f"{MAX_FRAME_BYTES}")
        payload = await reader.readexactly(length)
        if not hmac.compare_digest(_mac(self._key, header, payload), tag):
            raise PlaneAuthError(f"{self._proto.name} frame MAC does not verify")
        if seq != self._seq + 1:
            raise PlaneError(f"{self._proto.name} frame {seq} out of order (expected "
                             f"{self._seq + 1})")
        self._seq = seq
        try:
            return msgpack.unpackb(payload, raw=False, use_list=True)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is a broken frame
            raise PlaneError(f"{self._proto.name} frame does not decode: {exc}") from exc
