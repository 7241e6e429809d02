"""What the TCP planes beside the KV handoff share (the token plane, the KV event plane): a
challenge-response handshake on the cluster's token, then numbered frames MAC'd under the key.

The listening side sends MAGIC, version and a nonce; the connecting side answers its own nonce
and a proof over both; the listener checks it and answers its own proof, so each side knows the
other holds the token, which never crosses the wire. A frame is its payload's length and
sequence number, a MAC over both and the payload, then the payload (each plane encodes its own).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from dataclasses import dataclass

from pdserve import auth

_CONNECTOR_PROOF, _LISTENER_PROOF, _KEY = 1, 2, 0  # session ids: one proof per direction
_HEADER = struct.Struct("<IQ")  # payload length, sequence number
HEADER_BYTES = _HEADER.size + auth.MAC_BYTES
MAX_FRAME_BYTES = 64 * 2**20  # far above any plane's frame; bounds what a reader allocates
HANDSHAKE_TIMEOUT_S = 10.0
_PROOF_BYTES = 32


@dataclass(frozen=True)
class PlaneProtocol:
    """One plane's identity on the wire, the names its errors use and the errors it raises."""

    name: str  # "token plane"
    magic: bytes
    version: int
    purpose: auth.Purpose
    listener: str  # who listens, as errors name it
    connector: str
    auth_error: type[Exception]  # a peer without the token, or a frame whose MAC is wrong
    frame_error: type[Exception]  # a frame too long or out of order


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
        raise proto.auth_error(f"the {proto.connector}'s proof does not verify: it lacks the "
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
            raise proto.auth_error(f"the peer is not a pdserve {proto.name} of this version")
        peer_nonce = hello[len(magic) + 1:]
        nonce = auth.new_nonce()
        writer.write(nonce + auth.proof(token, _CONNECTOR_PROOF, nonce, peer_nonce,
                                        proto.purpose))
        peer_proof = await reader.readexactly(_PROOF_BYTES)
    if not auth.check_proof(token, _LISTENER_PROOF, nonce, peer_nonce, peer_proof,
                            proto.purpose):
        raise proto.auth_error(f"the {proto.listener}'s proof does not verify: it lacks the "
                               "cluster token")
    return auth.session_key(token, _KEY, nonce, peer_nonce, proto.purpose)


def _mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    digest = hmac.new(key, header, hashlib.sha256)
    digest.update(payload)
    return digest.digest()[:auth.MAC_BYTES]


class MacFramer:
    """Frames one connection's payloads: sequence numbers and MACs."""

    def __init__(self, key: bytes) -> None:
        self._key, self._seq = key, 0

    def frame(self, payload: bytes) -> bytes:
        self._seq += 1
        header = _HEADER.pack(len(payload), self._seq)
        return header + _mac(self._key, header, payload) + payload


class MacFrameReader:
    """Reads one connection's payloads, refusing any whose length, MAC or order is wrong."""

    def __init__(self, key: bytes, proto: PlaneProtocol) -> None:
        self._key, self._proto, self._seq = key, proto, 0

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        """The next frame's payload (IncompleteReadError when the peer closed)."""
        head = await reader.readexactly(HEADER_BYTES)
        header, tag = head[:_HEADER.size], head[_HEADER.size:]
        length, seq = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise self._proto.frame_error(f"frame of {length} bytes is over {MAX_FRAME_BYTES}")
        payload = await reader.readexactly(length)
        if not hmac.compare_digest(_mac(self._key, header, payload), tag):
            raise self._proto.auth_error("frame MAC does not verify")
        if seq != self._seq + 1:
            raise self._proto.frame_error(f"frame {seq} out of order (expected "
                                          f"{self._seq + 1})")
        self._seq = seq
        return payload
