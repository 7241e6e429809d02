"""The token plane's wire: how a decode replica proves itself to an ingress replica, and how
each engine step's new tokens for that ingress travel as one MAC'd msgpack frame.

The ingress listens; a decode replica connects. Handshake (the token never crosses the wire):
ingress sends MAGIC, version and a nonce; decode answers its own nonce and a proof over both;
the ingress checks it and answers its own proof, so each side knows the other holds the
cluster's token. Every frame then carries a sequence number and a MAC under the session key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve.engine.sampler import TokenLogprobs
from pdserve.handoff import auth

MAGIC = b"PDTP"
VERSION = 1
TOKENS = auth.Purpose(b"pdserve-tokens-proof-v1", b"pdserve-tokens-session-v1")
_DECODE_PROOF, _INGRESS_PROOF, _KEY = 1, 2, 0  # session ids: one proof per direction
_HEADER = struct.Struct("<IQ")  # payload length, sequence number
HEADER_BYTES = _HEADER.size + auth.MAC_BYTES
MAX_FRAME_BYTES = 64 * 2**20  # far above a step's tokens; bounds what a reader allocates
HANDSHAKE_TIMEOUT_S = 10.0


class TokenPlaneError(Exception):
    """The token plane failed: a peer that could not prove itself, or a broken frame."""


class TokenPlaneAuthError(TokenPlaneError):
    """The peer does not hold the cluster's token (or speaks another protocol)."""


@dataclass(frozen=True)
class TokenSink:
    """Where a decode replica sends a request's tokens: an ingress replica's token plane.
    ``plane_id`` tells one start of an ingress from the next on the same address."""

    host: str
    port: int
    plane_id: str


# One request's new output of one engine step, as it travels:
# [request_id, token_ids, text, finish_reason | None, num_output_tokens, num_cached_tokens,
#  logprobs | None, kv_reuse | None], logprobs as [[token_id, logprob, [[id, logprob], ...]],
#  ...], kv_reuse as `KVReuse.to_wire` (a locally prefilled request's first entry only).
Entry = list[Any]
ENTRY_FIELDS = 8


def encode_logprobs(logprobs: list[TokenLogprobs]) -> list[Any] | None:
    if not logprobs:
        return None
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs]


def decode_logprobs(raw: list[Any] | None) -> list[TokenLogprobs]:
    if not raw:
        return []
    return [TokenLogprobs(int(t), float(lp), [(int(i), float(v)) for i, v in top])
            for t, lp, top in raw]


def _frame_mac(key: bytes, header: bytes, payload: bytes) -> bytes:
    digest = hmac.new(key, header, hashlib.sha256)
    digest.update(payload)
    return digest.digest()[:auth.MAC_BYTES]


class FrameWriter:
    """Frames one connection's entries: sequence numbers, MACs, msgpack."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seq = 0
        self._packer = msgpack.Packer(use_bin_type=True)

    def frame(self, entries: list[Entry]) -> bytes:
        payload = self._packer.pack(entries)
        self._seq += 1
        header = _HEADER.pack(len(payload), self._seq)
        return header + _frame_mac(self._key, header, payload) + payload


class FrameReader:
    """Reads one connection's frames, refusing any whose MAC, order or shape is wrong."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seq = 0

    async def read(self, reader: asyncio.StreamReader) -> list[Entry]:
        """The next frame's entries (IncompleteReadError when the peer closed)."""
        head = await reader.readexactly(HEADER_BYTES)
        header, tag = head[:_HEADER.size], head[_HEADER.size:]
        length, seq = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise TokenPlaneError(f"frame of {length} bytes is over {MAX_FRAME_BYTES}")
        payload = await reader.readexactly(length)
        if not hmac.compare_digest(_frame_mac(self._key, header, payload), tag):
            raise TokenPlaneAuthError("frame MAC does not verify")
        if seq != self._seq + 1:
            raise TokenPlaneError(f"frame {seq} out of order (expected {self._seq + 1})")
        self._seq = seq
        return parse_entries(payload)


def parse_entries(payload: bytes) -> list[Entry]:
    try:
        entries = msgpack.unpackb(payload, raw=False, use_list=True)
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a broken frame
        raise TokenPlaneError(f"frame does not decode: {exc}") from exc
    if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == ENTRY_FIELDS and isinstance(e[0], str)
            for e in entries):
        raise TokenPlaneError("frame is not a list of token entries")
    return entries


async def ingress_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            token: str) -> bytes:
    """The listening side: challenge, check the decode replica's proof, prove back. Returns
    the session key."""
    nonce = auth.new_nonce()
    writer.write(MAGIC + bytes([VERSION]) + nonce)
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        answer = await reader.readexactly(auth.NONCE_BYTES + 32)
    peer_nonce, peer_proof = answer[:auth.NONCE_BYTES], answer[auth.NONCE_BYTES:]
    if not auth.check_proof(token, _DECODE_PROOF, peer_nonce, nonce, peer_proof, TOKENS):
        raise TokenPlaneAuthError("the peer's proof does not verify: it lacks the cluster token")
    writer.write(auth.proof(token, _INGRESS_PROOF, peer_nonce, nonce, TOKENS))
    await writer.drain()
    return auth.session_key(token, _KEY, peer_nonce, nonce, TOKENS)


async def decode_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           token: str) -> bytes:
    """The connecting side: answer the challenge, check the ingress's proof. Returns the
    session key."""
    async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
        hello = await reader.readexactly(len(MAGIC) + 1 + auth.NONCE_BYTES)
        if hello[:len(MAGIC)] != MAGIC or hello[len(MAGIC)] != VERSION:
            raise TokenPlaneAuthError("the peer is not a pdserve token plane of this version")
        peer_nonce = hello[len(MAGIC) + 1:]
        nonce = auth.new_nonce()
        writer.write(nonce + auth.proof(token, _DECODE_PROOF, nonce, peer_nonce, TOKENS))
        peer_proof = await reader.readexactly(32)
    if not auth.check_proof(token, _INGRESS_PROOF, nonce, peer_nonce, peer_proof, TOKENS):
        raise TokenPlaneAuthError("the ingress's proof does not verify: it lacks the cluster "
                                  "token")
    return auth.session_key(token, _KEY, nonce, peer_nonce, TOKENS)
