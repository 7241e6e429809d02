"""The sender's per-transfer state, without UCX: which pieces a layer completes, what they
carry, when a transfer fails on its own, and when it may release its source blocks."""

from __future__ import annotations

import concurrent.futures
import time

import torch

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.digest import digest
from pdserve.handoff.errors import HandoffCancelledError
from pdserve.handoff.kvcopy import cache_rows
from pdserve.handoff.outbound import OutboundTransfer
from pdserve.handoff.plan import plan_pieces
from pdserve.handoff.staging import StagingPool
from pdserve.handoff.ticket import HandoffTicket

LAYOUT = KVLayout("fp", "float16", block_size=4, num_layers=4, num_kv_heads=2, head_dim=8)
KV = KVSlice.whole(LAYOUT)
SRC = [5, 1, 7]


def transfer(pool_bytes: int = 1 << 20, layers_per_piece: int = 2) -> OutboundTransfer:
    ticket = HandoffTicket("r", 3, b"a", 1, "h", len(SRC), 10,
                           LAYOUT.num_local_layers * len(SRC) * LAYOUT.block_bytes, 1 << 20,
                           time.time() + 10, LAYOUT)
    plan = plan_pieces(KV, len(SRC), 1, 1 << 20, layers_per_piece)
    return OutboundTransfer(ticket, KV, torch.tensor(SRC), plan, StagingPool(pool_bytes),
                            time.monotonic() + 10)


def test_each_piece_is_ready_after_its_last_layer_with_the_caches_bytes_and_their_digest(
        ) -> None:
    cache = torch.randn(LAYOUT.cache_shape(8)).to(LAYOUT.torch_dtype)
    out = transfer()
    ready = [out.gather_layer(cache, layer, cache_rows(cache, LAYOUT)) for layer in range(4)]
    assert [[p.spec.index for p in r] for r in ready] == [[], [0], [], [1]]
    for piece in (ready[1][0], ready[3][0]):
        spec = piece.spec
        want = cache[spec.layer_start:spec.layer_end][:, :, SRC].contiguous()
        assert torch.equal(piece.payload, want.view(torch.uint8).reshape(-1))
        assert piece.digest == digest(piece.payload)  # hashed while gathering
    assert out.request_fence() and out.error is None


def test_layers_out_of_order_or_a_fence_too_early_fail_the_transfer_not_the_engine() -> None:
    cache = torch.zeros(LAYOUT.cache_shape(8), dtype=LAYOUT.torch_dtype)
    skipped = transfer()
    assert skipped.gather_layer(cache, 1, cache_rows(cache, LAYOUT)) == []
    assert skipped.error is not None and "out of order" in str(skipped.error)
    early = transfer()
    early.gather_layer(cache, 0, cache_rows(cache, LAYOUT))
    assert not early.request_fence() and "after 1 of 4 layers" in str(early.error)


def test_full_staging_defers_pieces_which_gather_later_to_the_same_bytes() -> None:
    """Backpressure, not failure: a piece that finds staging full (and every piece after it,
    even once room appeared) is handed over deferred, then gathered whole from the source
    blocks into the same bytes and digest a direct gather gives."""
    cache = torch.randn(LAYOUT.cache_shape(8)).to(LAYOUT.torch_dtype)
    rows = cache_rows(cache, LAYOUT)
    starved = transfer(pool_bytes=64 << 10, layers_per_piece=1)
    held = starved.pool.try_acquire(64 << 10)
    assert held is not None
    first = starved.gather_layer(cache, 0, rows)
    starved.pool.release(held)  # room again, yet later pieces stay behind the deferred one
    later = [starved.gather_layer(cache, layer, rows) for layer in range(1, 4)]
    deferred = first + [p for pieces in later for p in pieces]
    assert [type(p).__name__ for p in deferred] == ["DeferredPiece"] * 4
    assert starved.error is None and starved.request_fence()
    direct = transfer(layers_per_piece=1)
    expected = [direct.gather_layer(cache, layer, rows)[0] for layer in range(4)]
    for piece, want in zip(deferred, expected, strict=True):
        buffer = starved.pool.try_acquire(piece.spec.nbytes(KV))
        assert buffer is not None
        gathered = starved.gather_piece(piece, buffer)
        assert torch.equal(gathered.payload, want.payload)
        assert gathered.digest == want.digest
        starved.pool.release(buffer)


def test_release_waits_for_the_pump_every_send_and_a_known_outcome() -> None:
    out = transfer()
    assert not out.may_release()  # pump still running
    out.pump_done = True
    pending: concurrent.futures.Future[None] = concurrent.futures.Future()
    out.sends.add(pending)
    assert not out.may_release()  # a send in flight: the receiver may still read
    out.sends.clear()
    assert not out.may_release()  # all sent, but no DONE or failure yet
    out.confirmed = True
    assert out.may_release()
    failed = transfer()
    failed.pump_done = True
    assert failed.fail(HandoffCancelledError("client left"))
    assert not failed.fail(HandoffCancelledError("again"))  # the first error stands
    assert failed.may_release() and failed.result().error is not None
