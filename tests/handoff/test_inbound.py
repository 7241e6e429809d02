"""Receiver-side checks of one transfer: every header and fence against the reservation."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.digest import HOST_DIGEST, combine_digests
from pdserve.handoff.errors import (
    HandoffCancelledError,
    HandoffDigestError,
    HandoffError,
    HandoffLayoutError,
    HandoffProtocolError,
)
from pdserve.handoff.inbound import InboundState, InboundTransfer
from pdserve.handoff.plan import PieceSpec, plan_pieces

LAYOUT = KVLayout("fp", "float16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
SESSION = 11


def make_record(num_blocks: int = 4, layout: KVLayout = LAYOUT) -> InboundTransfer:
    ids = tuple(range(10, 10 + num_blocks))
    return InboundTransfer("req", 77, KVSlice.whole(layout), torch.tensor(ids), ids,
                           num_blocks * 4 - 1,
                           time.monotonic() + 10, 1 << 20, instance=5, digest_kind=HOST_DIGEST)


def begin(record: InboundTransfer, **changes: object) -> None:
    body = {"tid": 77, "instance": 5, "request_id": "req", "layout": LAYOUT.to_dict(),
            "heads": [0, 2], "num_blocks": record.num_blocks, "digest": HOST_DIGEST, **changes}
    record.accept_begin(SESSION, body)


def piece(index: int, layers: list[int], blocks: list[int], layout: KVLayout = LAYOUT,
          digest: int = 0, nbytes: int | None = None, kv: tuple[int, int] = (0, 2)) -> dict:
    size = ((layers[1] - layers[0]) * (blocks[1] - blocks[0]) * (kv[1] - kv[0])
            * layout.block_bytes // 2)
    return {"tid": 77, "index": index, "layers": layers, "kv": list(kv), "blocks": blocks,
            "nbytes": size if nbytes is None else nbytes, "digest": digest}


def fence_for(record: InboundTransfer, headers: list[dict], **changes: object) -> dict:
    specs = [(record.accept_piece(SESSION, h), h["nbytes"], h["digest"]) for h in headers]
    body = {"tid": 77, "num_pieces": len(specs), "nbytes": sum(s[1] for s in specs),
            "digest": combine_digests(specs), "first_token_id": 42,
            "num_tokens": record.num_tokens}
    body.update(changes)
    return body


def test_a_complete_transfer_becomes_ready_only_after_every_piece_landed() -> None:
    record = make_record()
    begin(record)
    headers = [piece(0, [0, 2], [0, 4], digest=1), piece(1, [2, 3], [0, 4], digest=2)]
    record.accept_fence(SESSION, fence_for(record, headers))
    assert record.completion() is None
    with pytest.raises(HandoffDigestError, match="piece 0 .* hashes to 0x7"):
        record.check_landed(PieceSpec(0, 0, 2, 0, 4), 7)  # not what its header said
    record.check_landed(PieceSpec(0, 0, 2, 0, 4), 1)
    assert record.completion() is None
    record.check_landed(PieceSpec(1, 2, 3, 0, 4), 2)
    info = record.completion()
    assert info is not None and info.first_token_id == 42 and info.num_pieces == 2
    assert record.finish(None, time.monotonic()) and record.state is InboundState.READY
    # The first outcome stands.
    assert not record.finish(HandoffCancelledError("late"), time.monotonic())
    assert not record.result.done()  # published only by publish()
    record.publish()
    assert record.result.result(0) == info


def test_layout_mismatch_names_the_field() -> None:
    record = make_record()
    other = replace(LAYOUT, head_dim=16).to_dict()
    with pytest.raises(HandoffLayoutError, match="head_dim: expected 8, got 16"):
        begin(record, layout=other)


def test_a_rank_of_another_tp_group_may_send_the_heads_it_holds_and_no_others() -> None:
    """Reserved: heads [1, 2) of a cache of all heads. A TP rank holding head 1 pairs; one
    holding head 0, or heads other than those reserved, is refused, naming why."""
    record = InboundTransfer("req", 77, KVSlice(LAYOUT, (1, 2)), torch.tensor([10]), (10,), 3,
                             time.monotonic() + 10, 1 << 20, instance=5, digest_kind=HOST_DIGEST)
    assert record.expected_bytes == 3 * LAYOUT.block_bytes // 2
    rank0, rank1 = (replace(LAYOUT, tp_rank=rank, tp_size=2).to_dict() for rank in range(2))
    with pytest.raises(HandoffLayoutError, match=r"KV heads \[1, 2\) are not in the other side's "
                                                 r"\[0, 1\) \(TP rank 0 of 2\)"):
        begin(record, layout=rank0, heads=[1, 2], num_blocks=1)
    record = InboundTransfer("req", 77, KVSlice(LAYOUT, (1, 2)), torch.tensor([10]), (10,), 3,
                             time.monotonic() + 10, 1 << 20, instance=5, digest_kind=HOST_DIGEST)
    with pytest.raises(HandoffLayoutError, match=r"sends KV heads \[0, 2\], \[1, 2\] were"):
        begin(record, layout=rank1, heads=[0, 2], num_blocks=1)
    begin(record, layout=rank1, heads=[1, 2], num_blocks=1)
    assert record.state is InboundState.RECEIVING


@pytest.mark.parametrize("changes, reason", [
    ({"instance": 6}, "another receiver instance"),
    ({"request_id": "someone-else"}, "ticket is for request"),
    ({"num_blocks": 5}, "5 blocks, 4 were reserved"),
    ({"layout": {"dtype": "float16"}}, "bad layout"),
    ({"digest": "modp31x3"}, "same device type"),
])
def test_begin_refusals(changes: dict, reason: str) -> None:
    with pytest.raises(HandoffError, match=reason):
        begin(make_record(), **changes)


@pytest.mark.parametrize("header, reason", [
    (piece(0, [0, 3], [0, 4], nbytes=1 << 30), "claims 1073741824 bytes; only"),
    (piece(0, [0, 1], [0, 4], nbytes=3 * 4 * LAYOUT.block_bytes), "its bounds hold"),
    (piece(0, [0, 4], [0, 1], nbytes=LAYOUT.block_bytes), "layers"),
    (piece(0, [1, 1], [0, 1], nbytes=LAYOUT.block_bytes), "layers"),
    (piece(0, [0, 1], [4, 5], nbytes=LAYOUT.block_bytes), "blocks"),
    (piece(0, [0, 1], [-1, 0], nbytes=LAYOUT.block_bytes), "blocks"),
    (piece(70000, [0, 1], [0, 1]), "out of range"),
])
def test_piece_refusals(header: dict, reason: str) -> None:
    record = make_record()
    begin(record)
    with pytest.raises(HandoffProtocolError, match=reason):
        record.accept_piece(SESSION, header)


def test_overlapping_or_repeated_pieces_and_foreign_sessions_are_refused() -> None:
    record = make_record()
    with pytest.raises(HandoffProtocolError, match="state reserved"):
        record.accept_piece(SESSION, piece(0, [0, 1], [0, 4]))
    begin(record)
    record.accept_piece(SESSION, piece(0, [0, 1], [0, 2]))
    with pytest.raises(HandoffProtocolError, match="repeated"):
        record.accept_piece(SESSION, piece(0, [1, 2], [0, 2]))
    with pytest.raises(HandoffProtocolError, match="overlaps"):
        record.accept_piece(SESSION, piece(1, [0, 2], [1, 3]))
    with pytest.raises(HandoffProtocolError, match="session"):
        record.accept_piece(SESSION + 1, piece(2, [2, 3], [0, 4]))


@pytest.mark.parametrize("changes, reason", [
    ({"num_pieces": 3}, "counts 3 pieces"),
    ({"nbytes": 1}, "counts 1 bytes"),
    ({"digest": 12345}, "digest does not match"),
    ({"num_tokens": 1}, "covers 1 tokens"),
    ({"first_token_id": -1}, "negative"),
])
def test_fence_refusals(changes: dict, reason: str) -> None:
    record = make_record()
    begin(record)
    with pytest.raises(HandoffProtocolError, match=reason):
        record.accept_fence(SESSION, fence_for(record, [piece(0, [0, 3], [0, 4])], **changes))


def test_fence_before_full_coverage_is_refused() -> None:
    record = make_record()
    begin(record)
    body = fence_for(record, [piece(0, [0, 2], [0, 4])])
    with pytest.raises(HandoffProtocolError, match="never announced"):
        record.accept_fence(SESSION, body)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 12), num_layers=st.integers(1, 5),
       max_piece_blocks=st.integers(1, 30), group=st.one_of(st.none(), st.integers(1, 6)))
def test_every_plan_is_accepted_and_covers_everything(num_blocks: int, num_layers: int,
                                                      max_piece_blocks: int,
                                                      group: int | None) -> None:
    layout = replace(LAYOUT, num_layers=num_layers, layer_end=num_layers)
    max_piece = max_piece_blocks * layout.block_bytes
    plan = plan_pieces(KVSlice.whole(layout), num_blocks, layout.block_bytes, max_piece, group)
    record = make_record(num_blocks, layout)
    record.max_piece_bytes = max_piece
    record.accept_begin(SESSION, {"tid": 77, "instance": 5, "request_id": "req",
                                  "layout": layout.to_dict(), "heads": [0, 2],
                                  "num_blocks": num_blocks, "digest": HOST_DIGEST})
    headers = [piece(s.index, [s.layer_start, s.layer_end], [s.block_start, s.block_end],
                     layout, digest=s.index) for s in plan]
    record.accept_fence(SESSION, fence_for(record, headers))
    assert all(s.nbytes(KVSlice.whole(layout)) <= max_piece for s in plan)
