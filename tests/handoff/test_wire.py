"""Control frames and authentication: round trips, tampering, bounds, schemas (no UCX)."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve import auth
from pdserve.handoff.wire import (
    CONTROL_TAG,
    MAX_FRAME_BYTES,
    MAX_PIECES,
    Kind,
    WireError,
    data_tag,
    decode,
    encode,
    peek,
    piece_entry,
    piece_header,
)

KEY = auth.session_key("secret", 7, b"s" * 16, b"r" * 16)
PIECE = {"tid": 9, "pieces": [piece_entry(2, (0, 1), (0, 2), (0, 3), 4096, 123)]}


def test_signed_frame_round_trips() -> None:
    frame = decode(encode(Kind.PIECE, 7, PIECE, KEY), KEY)
    assert (frame.kind, frame.session_id, frame.body) == (Kind.PIECE, 7, PIECE)


@pytest.mark.parametrize("position", [0, 10, 25, -1])
def test_any_flipped_byte_is_rejected(position: int) -> None:
    raw = bytearray(encode(Kind.PIECE, 7, PIECE, KEY))
    raw[position] ^= 0x01
    with pytest.raises(WireError):
        decode(bytes(raw), KEY)


def test_frames_under_another_session_key_are_rejected() -> None:
    other = auth.session_key("secret", 8, b"s" * 16, b"r" * 16)
    with pytest.raises(WireError, match="MAC"):
        decode(encode(Kind.FENCE, 7, {"tid": 1, "num_pieces": 1, "nbytes": 1, "digest": 1,
                                      "first_token_id": 0, "num_tokens": 1}, KEY), other)


def test_authenticated_kinds_need_a_key_both_ways() -> None:
    with pytest.raises(WireError):
        encode(Kind.BEGIN, 1, {}, None)
    raw = encode(Kind.PING, 1, {"seq": 1}, KEY)
    with pytest.raises(WireError, match="without a session"):
        decode(raw, None)
    hello = encode(Kind.HELLO, 1, {"address": b"a", "nonce": b"n", "host": "h",
                                      "scope": "h/ns", "pid": 7}, None)
    assert decode(hello, None).body["host"] == "h"


@pytest.mark.parametrize("body", [
    {**PIECE, "extra": 1},
    {k: v for k, v in PIECE.items() if k != "pieces"},
    {**PIECE, "tid": True},  # a bool is not an int here
    {**PIECE, "pieces": "4096"},
])
def test_schema_violations_are_rejected(body: dict) -> None:
    with pytest.raises(WireError):
        encode(Kind.PIECE, 1, body, KEY)


def test_piece_entries_round_trip_and_malformed_ones_are_refused() -> None:
    header = piece_header(piece_entry(5, (1, 2), (0, 1), (3, 9), 4096, 77))
    assert header == {"index": 5, "layers": [1, 2], "kv": [0, 1], "blocks": [3, 9],
                      "nbytes": 4096, "digest": 77}
    for bad in ([5, 1, 2], [5, 1, 2, 0, 1, 3, 9, 4096, True], "entry", [5] * 10):
        with pytest.raises(WireError, match="PIECE entry"):
            piece_header(bad)


def test_oversized_frames_cannot_be_built() -> None:
    with pytest.raises(WireError, match="exceeds"):
        encode(Kind.REFUSED, 1, {"reason": "x" * MAX_FRAME_BYTES}, None)


def test_head_checks() -> None:
    good = encode(Kind.PONG, 3, {"seq": 1}, KEY)
    assert peek(good) == (Kind.PONG, 3, len(good))
    with pytest.raises(WireError, match="magic"):
        peek(b"XXXX" + good[4:])
    with pytest.raises(WireError, match="version"):
        peek(good[:4] + bytes([99]) + good[5:])
    with pytest.raises(WireError, match="kind"):
        peek(good[:5] + bytes([200]) + good[6:])
    claims_more = good[:8] + struct.pack("<I", 10_000) + good[12:]
    with pytest.raises(WireError, match="more than it holds"):
        peek(claims_more)
    with pytest.raises(WireError, match="shorter"):
        peek(good[:10])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_garbage_never_escapes_as_another_exception(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(data, KEY)


def test_data_tags_are_distinct_and_bounded() -> None:
    tags = {data_tag(tid, idx) for tid in (1, 2, (1 << 32) - 1) for idx in (0, 1, MAX_PIECES - 1)}
    assert len(tags) == 9 and CONTROL_TAG not in tags
    for bad in ((0, 0), (1 << 32, 0), (1, MAX_PIECES), (1, -1)):
        with pytest.raises(ValueError):
            data_tag(*bad)


def test_proof_binds_token_session_and_both_nonces() -> None:
    good = auth.proof("secret", 5, b"a" * 16, b"b" * 16)
    assert auth.check_proof("secret", 5, b"a" * 16, b"b" * 16, good)
    assert not auth.check_proof("other", 5, b"a" * 16, b"b" * 16, good)
    assert not auth.check_proof("secret", 6, b"a" * 16, b"b" * 16, good)
    assert not auth.check_proof("secret", 5, b"a" * 16, b"c" * 16, good)
    assert auth.session_key("secret", 5, b"a" * 16, b"b" * 16) != good
