"""Fuzzing the handoff's trust boundary with hypothesis: the frame parser, the ticket, and the
receiver's header checks. Whatever arrives, the only exceptions are the handoff's own clear
errors, and no accepted piece can make the receiver write outside its reservation.
(Between two real processes: tests/handoff/test_frame_fuzz.py.)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.digest import HOST_DIGEST, combine_digests
from pdserve.handoff.errors import HandoffError
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.kvcopy import piece_view, scatter_piece
from pdserve.handoff.ticket import HandoffTicket
from pdserve.handoff.wire import MAC_BYTES, Kind, WireError, decode, encode, piece_header

KEY = b"k" * 32
LAYOUT = KVLayout("fp", "float16", block_size=2, num_layers=3, num_kv_heads=1, head_dim=4)
KV = KVSlice.whole(LAYOUT)
CACHE_BLOCKS = 12
RESERVED = (7, 2, 9, 4)
SESSION = 5
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# Values of every msgpack type, the odd ones included: what a buggy or hostile peer may send.
scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
           | st.floats(allow_nan=True) | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=6), max_leaves=20)
small_ints = st.integers(-3, 20) | st.integers(-(1 << 40), 1 << 40)
bounds = st.lists(small_ints, min_size=0, max_size=3) | values


def frame_bodies(kind: Kind) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies with the kind's field names (or not) and values of any type."""
    from pdserve.handoff.wire import _SCHEMAS

    names = list(_SCHEMAS[kind])
    return st.dictionaries(st.sampled_from([*names, "extra"]), values, max_size=len(names) + 1)


@FUZZ
@given(kind=st.sampled_from(list(Kind)), body=st.data(), flips=st.lists(
    st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=4),
    cut=st.integers(0, 1 << 16))
def test_mutated_frames_fail_only_with_wire_errors(kind: Kind, body: st.DataObject,
                                                   flips: list[tuple[int, int]], cut: int) -> None:
    """Encode any body (refused with WireError when it breaks the schema), then flip bytes and
    truncate: decoding never raises anything else, and a frame that still decodes passed its
    MAC, so it is exactly what was signed."""
    data = body.draw(frame_bodies(kind))
    key = None if kind in (Kind.HELLO, Kind.CHALLENGE, Kind.PROOF, Kind.REFUSED) else KEY
    try:
        raw = bytearray(encode(kind, 3, data, key))
    except WireError:
        return
    original = bytes(raw)
    for position, mask in flips:
        raw[position % len(raw)] ^= mask
    raw = raw[:max(1, len(raw) - cut % len(raw))] if cut % 3 == 0 else raw
    try:
        frame = decode(bytes(raw), key)
    except WireError:
        return
    if key is not None:  # authenticated: only an unchanged frame passes
        assert bytes(raw[:len(original) - MAC_BYTES]) == original[:-MAC_BYTES]
        assert frame.kind is kind and frame.body == data


@FUZZ
@given(entry=values)
def test_piece_entries_of_any_shape_fail_only_with_wire_errors(entry: Any) -> None:
    try:
        header = piece_header(entry)
    except WireError:
        return
    assert len(header) == 6


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(
    ["request_id", "transfer_id", "receiver_address", "receiver_instance", "receiver_host",
     "num_blocks", "num_tokens", "expected_bytes", "max_piece_bytes", "deadline", "layout",
     "kv_heads", "protocol_version", "surprise"]), values, max_size=4))
def test_tickets_from_the_router_fail_only_with_value_or_type_errors(
        changes: dict[str, Any]) -> None:
    good = HandoffTicket("r", 5, b"addr", 9, "h", 2, 3, 3 * 2 * LAYOUT.block_bytes, 1 << 20,
                         1.7e9, LAYOUT).to_dict()
    wire = msgpack.unpackb(msgpack.packb({**good, **changes}, use_bin_type=True), raw=False)
    with contextlib.suppress(ValueError, TypeError):
        HandoffTicket.from_dict(wire)


def reserved_record() -> InboundTransfer:
    return InboundTransfer("req", 77, KV, torch.tensor(RESERVED), RESERVED, 7,
                           time.monotonic() + 10, 4 * LAYOUT.block_bytes, 1, HOST_DIGEST)


begin_bodies = st.fixed_dictionaries({
    "tid": small_ints, "instance": st.sampled_from([1, 2]) | small_ints,
    "request_id": st.sampled_from(["req", "other"]) | st.text(max_size=4),
    "layout": st.sampled_from([LAYOUT.to_dict(), {**LAYOUT.to_dict(), "head_dim": 8}])
    | st.dictionaries(st.text(max_size=6), values, max_size=4),
    "heads": st.sampled_from([[0, 1], [1, 2]]) | bounds,
    "num_blocks": st.sampled_from([4, 3]) | small_ints,
    "digest": st.sampled_from([HOST_DIGEST, "modp31x3"]) | st.text(max_size=4)})
piece_bodies = st.fixed_dictionaries({
    "index": small_ints, "layers": bounds, "kv": bounds, "blocks": bounds,
    "nbytes": st.sampled_from([LAYOUT.block_bytes // 2 * k for k in (1, 2, 3, 4, 6, 8)])
    | small_ints, "digest": small_ints})
fence_bodies = st.fixed_dictionaries({
    "tid": small_ints, "num_pieces": small_ints, "nbytes": small_ints, "digest": small_ints,
    "first_token_id": small_ints, "num_tokens": st.just(7) | small_ints})


@FUZZ
@given(begin=begin_bodies, pieces=st.lists(piece_bodies, max_size=12),
       fence=st.none() | fence_bodies, sessions=st.lists(st.sampled_from([SESSION, 6]),
                                                          min_size=14, max_size=14))
def test_header_checks_raise_only_handoff_errors_and_never_allow_a_write_outside(
        begin: dict[str, Any], pieces: list[dict[str, Any]], fence: dict[str, Any] | None,
        sessions: list[int]) -> None:
    """Any sequence of BEGIN, PIECE and FENCE bodies (some from another session): each is
    accepted or refused with a `HandoffError`; every accepted piece is then scattered for
    real, and bytes outside the reserved blocks never change, nor more bytes than reserved
    ever get announced."""
    record = reserved_record()
    cache = torch.zeros(LAYOUT.cache_shape(CACHE_BLOCKS), dtype=LAYOUT.torch_dtype)
    rng = np.random.default_rng(0)
    with contextlib.suppress(HandoffError):
        record.accept_begin(sessions[0], begin)
    accepted = []
    for body, session in zip(pieces, sessions[1:], strict=False):
        try:
            spec = record.accept_piece(session, body)
        except HandoffError:
            continue
        assert spec.nbytes(KV) == body["nbytes"] <= record.max_piece_bytes
        payload = torch.from_numpy(rng.integers(0, 255, spec.nbytes(KV), dtype=np.uint8))
        scatter_piece(piece_view(payload, spec, KV), cache, record.block_ids, spec, KV)
        accepted.append((spec, spec.nbytes(KV), body["digest"]))
    assert sum(nbytes for _, nbytes, _ in accepted) <= record.expected_bytes
    outside = sorted(set(range(CACHE_BLOCKS)) - set(RESERVED))
    assert not cache[:, :, outside].view(torch.uint8).any()
    if fence is not None:
        body = {**fence, "digest": combine_digests(accepted)} if fence["digest"] == 0 else fence
        try:
            record.accept_fence(sessions[-1], body)
        except HandoffError:
            return
        assert record.completion() is None or len(accepted) == fence["num_pieces"]


@pytest.mark.parametrize("field", ["layers", "kv", "blocks"])
def test_a_bound_of_the_wrong_type_is_a_protocol_error_not_a_crash(field: str) -> None:
    record = reserved_record()
    record.accept_begin(SESSION, {"tid": 77, "instance": 1, "request_id": "req",
                                  "layout": LAYOUT.to_dict(), "heads": [0, 1], "num_blocks": 4,
                                  "digest": HOST_DIGEST})
    body = {"index": 0, "layers": [0, 1], "kv": [0, 2], "blocks": [0, 1],
            "nbytes": LAYOUT.block_bytes, "digest": 0}
    for bad in ([True, 2], [0.0, 1.0], "01", [0, 1, 2], {"0": 1}, [1, 0]):
        with pytest.raises(HandoffError, match=field):
            record.accept_piece(SESSION, {**body, field: bad})
