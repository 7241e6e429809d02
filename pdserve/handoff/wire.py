"""The handoff wire format: UCX tag layout and versioned control frames (binary head + msgpack).

Never pickle. Every frame is bounded (`MAX_FRAME_BYTES`) and checked field by field on decode.

Tags (64 bit): ``0xD5`` namespace byte | kind byte | 48 kind-specific bits. All control frames to
a worker use the one `CONTROL_TAG`; the payload of piece ``i`` of transfer ``t`` uses
``data_tag(t, i)`` (``t`` 32 bits, ``i`` 16 bits), so a receiver posts a buffer for exactly the
piece whose header it accepted.

Frame: ``<4s B B H I Q`` = magic ``PDHO``, version, kind, flags (0), body length, session id;
then the msgpack body; then a 16-byte MAC (HMAC-SHA256 with the session key over head + body;
zeros for the few kinds exchanged before a session key exists).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

from pdserve.auth import MAC_BYTES, check_mac, mac

WIRE_VERSION = 6
MAGIC = b"PDHO"
MAX_FRAME_BYTES = 64 * 1024
_HEAD = struct.Struct("<4sBBHIQ")
_NAMESPACE = 0xD5 << 56
CONTROL_TAG = _NAMESPACE | (1 << 48)
_DATA_KIND = 2 << 48
MAX_PIECES = 1 << 16
# A PIECE frame announces this many pieces at most, each as PIECE_FIELDS ints (~80 bytes):
# well under MAX_FRAME_BYTES.
PIECES_PER_FRAME = 256
PIECE_FIELDS = ("index", "layer_start", "layer_end", "kv_start", "kv_end", "block_start",
                "block_end", "nbytes", "digest")


class WireError(ValueError):
    """A frame that cannot be trusted or parsed; the receiver drops it and counts it."""


class Kind(enum.IntEnum):
    HELLO = 1  # sender -> receiver: session id, sender address, nonce, host, pid
    CHALLENGE = 2  # receiver -> sender: receiver nonce
    PROOF = 3  # sender -> receiver: HMAC(token, nonces)
    WELCOME = 4  # receiver -> sender (MAC'd: proves the receiver holds the token too)
    REFUSED = 5  # receiver -> sender: authentication failed
    BEGIN = 6  # sender -> receiver: transfer id, layout and KV heads, block count, digest kind
    PIECE = 7  # sender -> receiver: pieces' bounds, sizes and digests (up to PIECES_PER_FRAME)
    FENCE = 8  # sender -> receiver: counts, combined digest, first token
    ABORT_TO_RECEIVER = 9  # sender gives up a transfer
    ABORT_TO_SENDER = 10  # receiver failed/cancelled a transfer: stop sending
    PING = 11
    PONG = 12
    DONE = 13  # receiver -> sender: the fence verified, the KV is ready


UNAUTHENTICATED = frozenset({Kind.HELLO, Kind.CHALLENGE, Kind.PROOF, Kind.REFUSED})

# Field name -> accepted Python type(s), per kind. Every field is required; no others allowed.
_SCHEMAS: dict[Kind, dict[str, type | tuple[type, ...]]] = {
    Kind.HELLO: {"address": bytes, "nonce": bytes, "host": str, "scope": str, "pid": int},
    Kind.CHALLENGE: {"nonce": bytes, "instance": int},
    Kind.PROOF: {"proof": bytes},
    Kind.WELCOME: {"instance": int, "scope": str, "pid": int},
    Kind.REFUSED: {"reason": str},
    Kind.BEGIN: {"tid": int, "instance": int, "request_id": str, "layout": dict, "heads": list,
                 "num_blocks": int, "digest": str},
    Kind.PIECE: {"tid": int, "pieces": list},
    Kind.FENCE: {"tid": int, "num_pieces": int, "nbytes": int, "digest": int,
                 "first_token_id": int, "num_tokens": int},
    Kind.ABORT_TO_RECEIVER: {"tid": int, "code": str, "message": str},
    Kind.ABORT_TO_SENDER: {"tid": int, "code": str, "message": str},
    Kind.PING: {"seq": int},
    Kind.PONG: {"seq": int},
    Kind.DONE: {"tid": int},
}


def piece_entry(index: int, layers: tuple[int, int], kv: tuple[int, int],
                blocks: tuple[int, int], nbytes: int, digest: int) -> list[int]:
    """One piece's announcement inside a PIECE frame (``PIECE_FIELDS`` order)."""
    return [index, *layers, *kv, *blocks, nbytes, digest]


def piece_header(entry: Any) -> dict[str, Any]:
    """An announced piece as the named header the receiver checks; WireError if malformed."""
    if (not isinstance(entry, list) or len(entry) != len(PIECE_FIELDS)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
        raise WireError(f"a PIECE entry must be {len(PIECE_FIELDS)} ints {PIECE_FIELDS}")
    return {"index": entry[0], "layers": entry[1:3], "kv": entry[3:5], "blocks": entry[5:7],
            "nbytes": entry[7], "digest": entry[8]}


def data_tag(transfer_id: int, piece_index: int) -> int:
    if not 0 < transfer_id < 1 << 32:
        raise ValueError(f"transfer id {transfer_id} outside (0, 2**32)")
    if not 0 <= piece_index < MAX_PIECES:
        raise ValueError(f"piece index {piece_index} outside [0, {MAX_PIECES})")
    return _NAMESPACE | _DATA_KIND | (transfer_id << 16) | piece_index


@dataclass(frozen=True)
class Frame:
    """One decoded, schema-checked control frame. ``body`` holds exactly the kind's fields."""

    kind: Kind
    session_id: int
    body: dict[str, Any]


def encode(kind: Kind, session_id: int, body: dict[str, Any], key: bytes | None) -> bytes:
    """Serialise a frame; ``key`` is the session key (None only for `UNAUTHENTICATED` kinds)."""
    _check_schema(kind, body)
    payload = msgpack.packb(body, use_bin_type=True)
    head = _HEAD.pack(MAGIC, WIRE_VERSION, int(kind), 0, len(payload), session_id)
    if len(head) + len(payload) + MAC_BYTES > MAX_FRAME_BYTES:
        raise WireError(f"{kind.name} frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    if key is None:
        if kind not in UNAUTHENTICATED:
            raise WireError(f"{kind.name} frames must carry a session MAC")
        tail = bytes(MAC_BYTES)
    else:
        tail = mac(key, head + payload)
    return head + payload + tail


def peek(buffer: bytes | memoryview) -> tuple[Kind, int, int]:
    """Parse the fixed head: (kind, session id, total frame length). Raises `WireError`."""
    if len(buffer) < _HEAD.size + MAC_BYTES:
        raise WireError(f"frame of {len(buffer)} bytes is shorter than a frame head")
    magic, version, kind, flags, body_len, session_id = _HEAD.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise WireError("bad frame magic (not a pdserve handoff frame)")
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version} unsupported (this build speaks {WIRE_VERSION})")
    if flags != 0:
        raise WireError(f"unknown frame flags {flags:#x}")
    try:
        parsed = Kind(kind)
    except ValueError as exc:
        raise WireError(f"unknown frame kind {kind}") from exc
    total = _HEAD.size + body_len + MAC_BYTES
    if total > min(len(buffer), MAX_FRAME_BYTES):
        raise WireError(f"frame claims {body_len} body bytes, more than it holds")
    return parsed, session_id, total


def decode(buffer: bytes | memoryview, key: bytes | None) -> Frame:
    """Check and parse a frame. ``key`` None accepts only `UNAUTHENTICATED` kinds."""
    kind, session_id, total = peek(buffer)
    signed = bytes(buffer[: total - MAC_BYTES])
    tag = bytes(buffer[total - MAC_BYTES : total])
    if key is None:
        if kind not in UNAUTHENTICATED:
            raise WireError(f"{kind.name} frame from a peer without a session")
    elif not check_mac(key, signed, tag):
        raise WireError(f"{kind.name} frame fails its MAC (wrong session key or tampered)")
    try:
        body = msgpack.unpackb(
            signed[_HEAD.size :], raw=False, strict_map_key=True, use_list=True,
            max_bin_len=MAX_FRAME_BYTES, max_str_len=MAX_FRAME_BYTES,
            max_array_len=1024, max_map_len=64,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"{kind.name} body is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise WireError(f"{kind.name} body is not a map")
    _check_schema(kind, body)
    return Frame(kind, session_id, body)


def _check_schema(kind: Kind, body: dict[str, Any]) -> None:
    schema = _SCHEMAS[kind]
    missing = schema.keys() - body.keys()
    extra = body.keys() - schema.keys()
    if missing or extra:
        raise WireError(
            f"{kind.name} fields: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for name, expected in schema.items():
        value = body[name]
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise WireError(f"{kind.name}.{name} must be {expected}, got {type(value).__name__}")
