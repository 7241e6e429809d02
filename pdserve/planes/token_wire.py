"""The token plane's wire: how a decode replica proves itself to an ingress replica, and how
each engine step's new tokens for that ingress travel as one MAC'd msgpack frame.

The ingress listens; a decode replica connects. The handshake and the numbered, MAC'd
frames are `planes/link.py`'s, under this plane's labels.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgpack

from pdserve import auth
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.planes.link import (
    MacFramer,
    MacFrameReader,
    PlaneProtocol,
    connector_handshake,
    listener_handshake,
)


class TokenPlaneError(Exception):
    """The token plane failed: a peer that could not prove itself, or a broken frame."""


class TokenPlaneAuthError(TokenPlaneError):
    """The peer does not hold the cluster's token (or speaks another protocol)."""


TOKEN_PLANE = PlaneProtocol(
    name="token plane", magic=b"PDTP", version=1,
    purpose=auth.Purpose(b"pdserve-tokens-proof-v1", b"pdserve-tokens-session-v1"),
    listener="ingress", connector="decode replica",
    auth_error=TokenPlaneAuthError, frame_error=TokenPlaneError)


@dataclass(frozen=True)
class TokenSink:
    """Where a decode replica sends a request's tokens: an ingress replica's token plane.
    ``plane_id`` tells one start of an ingress from the next on the same address."""

    host: str
    port: int
    plane_id: str


# One request's new output of one engine step, as it travels:
# [request_id, token_ids, text, finish_reason | None, num_output_tokens, num_cached_tokens,
#  logprobs | None, kv_reuse | None, prev_token_id], logprobs as [[token_id, logprob,
#  [[id, logprob], ...]], ...], kv_reuse as `KVReuse.to_wire` (a locally prefilled request's
#  first entry only), prev_token_id the output token the entry's tokens continue (-1: none).
# num_output_tokens and prev_token_id let the ingress check that an entry continues exactly
# the tokens its client has (router/token_plane.py `TokenSubscription`).
Entry = list[Any]
ENTRY_FIELDS = 9


def encode_logprobs(logprobs: list[TokenLogprobs]) -> list[Any] | None:
    if not logprobs:
        return None
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs]


def decode_logprobs(raw: list[Any] | None) -> list[TokenLogprobs]:
    if not raw:
        return []
    return [TokenLogprobs(int(t), float(lp), [(int(i), float(v)) for i, v in top])
            for t, lp, top in raw]


class FrameWriter:
    """Frames one connection's entries: msgpack, then `MacFramer`."""

    def __init__(self, key: bytes) -> None:
        self._framer = MacFramer(key)
        self._packer = msgpack.Packer(use_bin_type=True)

    def frame(self, entries: list[Entry]) -> bytes:
        return self._framer.frame(self._packer.pack(entries))


class FrameReader:
    """Reads one connection's frames, refusing any whose MAC, order or shape is wrong."""

    def __init__(self, key: bytes) -> None:
        self._frames = MacFrameReader(key, TOKEN_PLANE)

    async def read(self, reader: asyncio.StreamReader) -> list[Entry]:
        """The next frame's entries (IncompleteReadError when the peer closed)."""
        return parse_entries(await self._frames.read(reader))


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
    """The ingress (listening) side; returns the session key."""
    return await listener_handshake(reader, writer, token, TOKEN_PLANE)


async def decode_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           token: str) -> bytes:
    """The decode (connecting) side; returns the session key."""
    return await connector_handshake(reader, writer, token, TOKEN_PLANE)
