"""Prefill side of the handoff: push each request's KV, layer by layer as the engine writes it,
into the blocks a decode worker reserved; then the fence; then report when its memory is free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.kv.layout import KVLayout, KVSlice, LayoutMismatchError
from pdserve.handoff.contract import KVSender
from pdserve.handoff.device_stream import HandoffStream
from pdserve.handoff.digest import digest, digest_kind
from pdserve.handoff.errors import (
    HandoffCancelledError,
    HandoffCapacityError,
    HandoffError,
    HandoffLayoutError,
    HandoffPeerGoneError,
    HandoffTimeoutError,
    error_from_code,
)
from pdserve.handoff.kvcopy import cache_rows
from pdserve.handoff.outbound import (
    DeferredPiece,
    FenceRequest,
    OutboundTransfer,
    ReadyPiece,
    Record,
)
from pdserve.handoff.peers import PeerLink
from pdserve.handoff.plan import plan_pieces
from pdserve.handoff.staging import StagingAdmission, StagingPool, StagingStats
from pdserve.handoff.ticket import HandoffTicket
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import PIECES_PER_FRAME, Kind, WireError, data_tag, peek, piece_entry

log = logging.getLogger(__name__)
_ROLE_KINDS = (Kind.CHALLENGE, Kind.WELCOME, Kind.REFUSED, Kind.PONG, Kind.ABORT_TO_SENDER,
               Kind.DONE)


@dataclass(frozen=True)
class SenderStats:
    num_active: int
    num_links: int
    num_ok: int
    num_failed: int
    staging: StagingStats


class HandoffSender(KVSender):
    """Pushes KV to receivers over pooled, authenticated links (one per receiver address,
    many transfers multiplexed on it). Implements `KVSender` (the contract: block ownership,
    deferred free); `send_layer` gathers each finished layer into staging and returns, so the
    network never blocks compute.

    Staging is a bounded ring with backpressure: a piece that finds it full is gathered later
    from its (pinned) source blocks, in order, as sends complete and free buffers; a transfer
    of any size streams through.
    """

    def __init__(self, transport: HandoffTransport, *,
                 device: torch.device | str = "cpu") -> None:
        """``device``: where the KV cache lives (staging buffers are allocated there)."""
        self._transport = transport
        self._config = transport.config
        self._pool = StagingPool(self._config.sender_staging_bytes, device)
        self._admission = StagingAdmission(self._pool)  # loop only: deferred pieces wait here
        self._stream = HandoffStream(self._pool.device)
        self._links: dict[bytes, PeerLink] = {}  # loop only
        self._by_session: dict[int, PeerLink] = {}  # loop only
        self._active: dict[int, OutboundTransfer] = {}  # loop only, by transfer id
        self._counts = {"ok": 0, "failed": 0}
        self._detach = transport.attach(_ROLE_KINDS, self._on_frame, self._heartbeat,
                                        self._on_shutdown)

    # ---- engine API --------------------------------------------------------------------
    def start_transfer(self, ticket: HandoffTicket, block_ids: Sequence[int], layout: KVLayout,
                       *, layers_per_piece: int | None = None) -> OutboundTransfer:
        """`KVSender.start_transfer`. ``layers_per_piece`` (tests, benchmarks) forces pieces of
        that many layers instead of grouping up to ``config.min_piece_bytes``."""
        if len(block_ids) != ticket.num_blocks:
            raise ValueError(f"{len(block_ids)} source blocks for a ticket of {ticket.num_blocks}")
        try:
            layout.check_pairs_with(ticket.layout, ticket.kv.heads)
        except LayoutMismatchError as exc:
            mismatch: HandoffLayoutError | None = HandoffLayoutError(
                f"cannot send into ticket {ticket.transfer_id}: {exc}")
            kv, plan = KVSlice.whole(layout), []
        else:
            mismatch, kv = None, KVSlice(layout, ticket.kv.heads)
            plan = plan_pieces(kv, ticket.num_blocks, self._config.min_piece_bytes,
                               ticket.max_piece_bytes, layers_per_piece)
        ids = self._stream.to_device([int(b) for b in block_ids])
        transfer = OutboundTransfer(ticket, kv, ids, plan, self._pool,
                                    time.monotonic() + (ticket.deadline - time.time()),
                                    self._stream)
        if mismatch is not None:  # BEGIN still goes out: the receiver refuses it, naming why
            transfer.fail(mismatch)
        transfer.queue = asyncio.Queue()  # binds to the handoff loop on first use
        self._transport.call_soon(self._begin, transfer)  # runs before any later call_soon
        return transfer

    def send_layer(self, cache: torch.Tensor, layer: int,
                   transfers: Sequence[OutboundTransfer]) -> None:
        if cache.device != self._pool.device:
            raise ValueError(f"cache on {cache.device}, sender staging on {self._pool.device}: "
                             f"construct HandoffSender(transport, device=cache.device)")
        with self._stream.after_engine():
            for transfer in transfers:
                src_rows = None if cache.is_cuda else cache_rows(cache, transfer.kv.layout)
                for piece in transfer.gather_layer(cache, layer, src_rows):
                    self._transport.call_soon(self._enqueue, transfer, piece)

    def send_fence(self, transfer: OutboundTransfer,
                   first_token_id: int) -> None:
        transfer.request_fence()
        self._transport.call_soon(self._enqueue, transfer, FenceRequest(first_token_id))

    def cancel(self, transfer: OutboundTransfer,
               reason: str = "cancelled by the prefill worker") -> None:
        self._transport.call_soon(self._abort, transfer, HandoffCancelledError(reason))

    def close(self) -> None:
        """Abort every transfer and close links (the transport keeps running). Loop-safe."""
        self._detach()
        self._transport.call_soon(self._on_shutdown)

    def stats(self) -> SenderStats:
        return SenderStats(len(self._active), len(self._links), self._counts["ok"],
                           self._counts["failed"], self._pool.stats())

    # ---- loop: per-transfer lifetime -------------------------------------------------------
    def _begin(self, transfer: OutboundTransfer) -> None:
        self._active[transfer.transfer_id] = transfer
        transfer.link = link = self._link_for(transfer.ticket)
        link.transfers.add(transfer)
        delay = max(0.0, transfer.deadline - time.monotonic()) + self._config.send_grace_s
        self._transport.loop.call_later(delay, self._expire, transfer)
        transfer.pump = self._transport.spawn(self._pump(transfer, link))
        # A callback, not a finally: it also runs if the task is cancelled before it started.
        transfer.pump.add_done_callback(lambda _: self._close_pump(transfer, link))
        if link.dead is not None:  # failed while connecting, before this transfer joined
            self._abort(transfer, type(link.dead)(str(link.dead)))

    def _link_for(self, ticket: HandoffTicket) -> PeerLink:
        link = self._links.get(ticket.receiver_address)
        if link is None or link.dead is not None:
            link = PeerLink(self._transport, ticket.receiver_address, ticket.receiver_host,
                            self._link_down)
            self._links[ticket.receiver_address] = link
            self._by_session[link.session_id] = link
        return link

    def _enqueue(self, transfer: OutboundTransfer, item: ReadyPiece | FenceRequest) -> None:
        if transfer.pump_done:
            if isinstance(item, ReadyPiece):
                self._release_piece(item)
            return
        transfer.queue.put_nowait(item)

    def _close_pump(self, transfer: OutboundTransfer, link: PeerLink) -> None:
        transfer.pump_done = True
        error = transfer.error
        if (error is not None and transfer.begun and not transfer.receiver_aborted
                and link.dead is None):
            link.send(Kind.ABORT_TO_RECEIVER, {"tid": transfer.transfer_id, "code": error.code,
                                               "message": str(error)})
        while not transfer.queue.empty():
            item = transfer.queue.get_nowait()
            if isinstance(item, ReadyPiece):
                self._release_piece(item)
        self._maybe_release(transfer)

    def _maybe_release(self, transfer: OutboundTransfer) -> None:
        if not transfer.may_release():
            return
        for buffer in transfer.take_unfinished_buffers():
            self._admission.release(buffer)
        self._active.pop(transfer.transfer_id, None)
        transfer.link.transfers.discard(transfer)
        result = transfer.result()
        self._counts["ok" if result.ok else "failed"] += 1
        if not result.ok:
            log.info("handoff push of %s ended: %s", transfer.request_id, result.error)
        transfer.released.set_result(result)

    # ---- loop: one task per transfer ---------------------------------------------------------
    async def _pump(self, transfer: OutboundTransfer, link: PeerLink) -> None:
        """BEGIN, then pieces in order as the compute thread queues them, then the fence. Every
        announced piece is sent, even after an abort (the receiver drains it), so the receiver
        never waits on a piece that cannot come."""
        try:
            await link.ready
            link.send(Kind.BEGIN, transfer.begin_body(digest_kind(self._pool.device)))
            transfer.begun = True
            records: list[Record] = []
            while transfer.error is None:
                pieces, last = await self._next_items(transfer)
                if transfer.error is not None:
                    for piece in pieces:
                        self._release_piece(piece)
                    break
                if pieces:
                    records.extend(await self._announce(transfer, link, pieces))
                if isinstance(last, FenceRequest):
                    link.send(Kind.FENCE, transfer.fence_body(records, last.first_token_id))
                    break
                if last is None and not pieces:
                    break  # woken to stop
        except HandoffError as exc:
            transfer.fail(exc)

    async def _next_items(self, transfer: OutboundTransfer,
                          ) -> tuple[list[ReadyPiece], FenceRequest | None]:
        """Every gathered piece queued right now (one frame announces them all), and a fence if
        one follows them; or one deferred piece, once it has staging and was gathered (the
        pieces before it went out first). ([], None) is the wake-up to stop."""
        item = transfer.lookahead or await transfer.queue.get()
        transfer.lookahead = None
        if isinstance(item, DeferredPiece):
            gathered = await self._gather_deferred(transfer, item)
            return ([] if gathered is None else [gathered]), None
        pieces: list[ReadyPiece] = []
        while isinstance(item, ReadyPiece):
            pieces.append(item)
            if transfer.queue.empty() or len(pieces) == PIECES_PER_FRAME:
                return pieces, None
            item = transfer.queue.get_nowait()
            if isinstance(item, DeferredPiece):
                transfer.lookahead = item
                return pieces, None
        return pieces, item

    async def _gather_deferred(self, transfer: OutboundTransfer,
                               piece: DeferredPiece) -> ReadyPiece | None:
        """Wait (first come, first served) for staging, then gather the piece off the loop.
        None when the transfer failed meanwhile."""
        nbytes = piece.spec.nbytes(transfer.kv)
        if not self._pool.fits_ever(nbytes):
            transfer.fail(HandoffCapacityError(
                f"piece of {nbytes} bytes exceeds the sender's staging "
                f"({self._pool.capacity_bytes} bytes)"))
            return None
        buffer = await self._admission.acquire(nbytes, lambda: transfer.error is not None)
        if buffer is None:
            return None
        job = asyncio.ensure_future(self._transport.run_payload(transfer.gather_piece, piece,
                                                                buffer))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda _: self._admission.release(buffer))
            raise
        except Exception as exc:  # noqa: BLE001 - a failed copy ends this transfer only
            self._admission.release(buffer)
            transfer.fail(HandoffError(f"gathering piece {piece.spec.index} failed: {exc}"))
            return None

    async def _announce(self, transfer: OutboundTransfer, link: PeerLink,
                        pieces: list[ReadyPiece]) -> list[Record]:
        """One PIECE frame for ``pieces``, then their payload sends."""
        records, entries = [], []
        for position, piece in enumerate(pieces):
            spec, nbytes = piece.spec, piece.spec.nbytes(transfer.kv)
            try:
                piece_digest = await self._digest(piece)
            except asyncio.CancelledError:  # none announced yet; this one's digest job frees it
                for unsent in pieces[:position] + pieces[position + 1:]:
                    self._release_piece(unsent)
                raise
            entries.append(piece_entry(spec.index, (spec.layer_start, spec.layer_end),
                                       (spec.kv_start, spec.kv_end),
                                       (spec.block_start, spec.block_end), nbytes,
                                       piece_digest))
            records.append((spec, nbytes, piece_digest))
        link.send(Kind.PIECE, {"tid": transfer.transfer_id, "pieces": entries})
        for piece in pieces:
            tag = data_tag(transfer.transfer_id, piece.spec.index)
            task = self._transport.spawn(self._transport.send_payload(link.endpoint,
                                                                      piece.payload, tag))
            transfer.sends.add(task)
            task.add_done_callback(lambda done, p=piece: self._sent(transfer, p, done))
        return records

    async def _digest(self, piece: ReadyPiece) -> int:
        """The digest taken during the gather, or (CUDA) one taken now on the device, off the
        loop, once the gather's event completed."""
        if piece.digest is not None:
            return piece.digest
        job = asyncio.ensure_future(self._transport.run_payload(self._wait_and_digest,
                                                                piece.payload, piece.event))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda _: self._release_piece(piece))
            raise

    def _sent(self, transfer: OutboundTransfer, piece: ReadyPiece,
              task: asyncio.Task[None]) -> None:
        """Bookkeeping of one payload send (a callback: runs even if cancelled unstarted)."""
        transfer.sends.discard(task)
        if task.cancelled():
            self._pool.quarantine(piece.buffer)  # the peer may still read it: never reuse
            self._admission.pump()
        elif task.exception() is not None:
            self._release_piece(piece)
            transfer.fail(HandoffPeerGoneError(
                f"sending piece {piece.spec.index} failed: {task.exception()}"))
        else:
            transfer.bytes_sent += piece.spec.nbytes(transfer.kv)
            transfer.pieces_sent += 1
            self._release_piece(piece)
        self._maybe_release(transfer)

    def _release_piece(self, piece: ReadyPiece) -> None:
        self._admission.release(piece.buffer)

    def _wait_and_digest(self, view: torch.Tensor, event: object) -> int:
        """Payload thread: a CUDA piece's digest on the handoff stream, once gathered."""
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
        with self._stream.active():
            return digest(view)

    # ---- loop: failures -------------------------------------------------------------------------
    def _abort(self, transfer: OutboundTransfer, error: HandoffError, *,
               from_receiver: bool = False, force: bool = False) -> None:
        """Stop pushing (the pump tells the receiver unless it was the receiver's call).
        Announced pieces still go out, for the receiver drains them, unless ``force``: then
        in-flight sends are cancelled (dead peer, deadline long past)."""
        if transfer.fail(error) and from_receiver:
            transfer.receiver_aborted = True
        if not transfer.pump_done:
            transfer.queue.put_nowait(None)
        self._admission.pump()  # a deferred piece waiting for staging gives up
        if force:
            transfer.pump.cancel()
            for task in list(transfer.sends):
                task.cancel()
        self._maybe_release(transfer)

    def _expire(self, transfer: OutboundTransfer) -> None:
        if not transfer.released.done():
            self._abort(transfer, HandoffTimeoutError(
                f"push of {transfer.request_id!r} still in flight {self._config.send_grace_s}s "
                f"after its deadline"), force=True)

    def _on_frame(self, kind: Kind, raw: bytes) -> None:
        link = self._by_session.get(peek(raw)[1])
        if link is None:
            return
        try:
            frame = link.on_frame(kind, raw)
        except WireError as exc:
            log.warning("rejected a %s frame from %s: %s", kind.name, link.host, exc)
            return
        transfer = self._active.get(frame.body["tid"]) if frame is not None else None
        if frame is None or transfer is None or transfer not in link.transfers:
            return
        if kind is Kind.DONE:
            transfer.confirmed = True
            self._maybe_release(transfer)
        elif kind is Kind.ABORT_TO_SENDER:
            cause = error_from_code(frame.body["code"], frame.body["message"])
            self._abort(transfer, type(cause)(f"receiver ended the transfer: {cause}"),
                        from_receiver=True)

    def _link_down(self, link: PeerLink) -> None:
        """A link failed (peer gone, endpoint error, refused): its transfers fail now, their
        in-flight sends are given up (UCX does not end sends to a dead peer on shared memory;
        their staging buffers are retired, never reused)."""
        assert link.dead is not None
        for transfer in list(link.transfers):
            self._abort(transfer, type(link.dead)(str(link.dead)), force=True)
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._by_session.pop(link.session_id, None)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for link in list(self._links.values()):
            link.ping_if_due(now)

    def _on_shutdown(self) -> None:
        for transfer in list(self._active.values()):
            self._abort(transfer, HandoffCancelledError("prefill handoff sender shutting down"),
                        force=True)
        for link in list(self._links.values()):
            link.fail(HandoffCancelledError("sender shutting down"))

