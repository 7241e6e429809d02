"""Prefill side, loop thread: one task per transfer that sends BEGIN (and SOURCE for a
same-host read), announces and sends its pieces in order as the compute thread queues them,
then the fence.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import torch

from pdserve.handoff.errors import HandoffError, HandoffPeerGoneError
from pdserve.handoff.faults import SenderFaults
from pdserve.handoff.kvcopy import combine_digests, digest
from pdserve.handoff.outbound import FenceRequest, OutboundTransfer, ReadyPiece
from pdserve.handoff.peers import PeerLink
from pdserve.handoff.piece_plan import PieceSpec
from pdserve.handoff.staging import StagingPool
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import PIECES_PER_FRAME, Kind, data_tag, piece_entry


class PiecePump:
    """Runs transfers' pumps on the handoff loop. Staging buffers go back to ``pool`` once
    their send ended (quarantined if a cancelled send may still be read); ``on_sent(transfer)``
    runs after each payload send, for the sender to see whether the transfer is over."""

    def __init__(self, transport: HandoffTransport, pool: StagingPool, faults: SenderFaults,
                 on_sent: Callable[[OutboundTransfer], None]) -> None:
        self._transport, self._pool, self._faults = transport, pool, faults
        self._on_sent = on_sent
        self.num_begun_in_slot = 0  # transfers whose receiver needed no BEGIN/SOURCE frames

    async def run(self, transfer: OutboundTransfer, link: PeerLink) -> None:
        """Announce and send pieces in order, then the fence. Exits on fence or on error."""
        try:
            await link.ready
            if self._faults.begin_frames_delay_s:
                await asyncio.sleep(self._faults.begin_frames_delay_s)
            self._begin(transfer, link)
            records: list[tuple[PieceSpec, int, int]] = []
            while transfer.error is None:
                pieces, last = await self._next_items(transfer)
                if transfer.error is not None:
                    for piece in pieces:
                        self.release(piece)
                    break
                if pieces:
                    records.extend(await self._announce(transfer, link, pieces))
                if isinstance(last, FenceRequest):
                    if transfer.slot is None:  # else the fence went into the slot
                        link.send(Kind.FENCE, self._fence_body(transfer, last, records))
                    break
                if last is None and not pieces:
                    break  # woken to stop
        except HandoffError as exc:
            transfer.fail(exc)

    def _begin(self, transfer: OutboundTransfer, link: PeerLink) -> None:
        """BEGIN and, for a same-host read, SOURCE; neither when the receiver already
        started the transfer from its slot's begin records (it left its mark there)."""
        ticket = transfer.ticket
        transfer.begun = True
        if transfer.slot is not None and transfer.slot.claimed_by(ticket.receiver_instance):
            self.num_begun_in_slot += 1  # loop only
            return
        link.send(Kind.BEGIN, {"tid": ticket.transfer_id, "instance": ticket.receiver_instance,
                               "request_id": ticket.request_id,
                               "layout": transfer.layout.to_dict(),
                               "num_blocks": ticket.num_blocks, "pid": os.getpid()})
        if transfer.source is not None:
            link.send(Kind.SOURCE, transfer.source.source_body(
                ticket.transfer_id, transfer.block_ids, transfer.slot,
                self._faults.source_address_shift))

    @staticmethod
    async def _next_items(transfer: OutboundTransfer,
                          ) -> tuple[list[ReadyPiece], FenceRequest | None]:
        """Every piece queued right now (one frame announces them all), and a fence if one
        follows them. ([], None) is the wake-up to stop."""
        item = await transfer.queue.get()
        pieces: list[ReadyPiece] = []
        while isinstance(item, ReadyPiece):
            pieces.append(item)
            if transfer.queue.empty() or len(pieces) == PIECES_PER_FRAME:
                return pieces, None
            item = transfer.queue.get_nowait()
        return pieces, item

    async def _announce(self, transfer: OutboundTransfer, link: PeerLink,
                        pieces: list[ReadyPiece]) -> list[tuple[PieceSpec, int, int]]:
        """One PIECE frame for ``pieces``, then their payload sends."""
        records, entries, views = [], [], []
        for position, piece in enumerate(pieces):
            spec, nbytes = piece.spec, piece.spec.nbytes(transfer.layout)
            try:
                piece_digest = await self._digest(piece)
            except asyncio.CancelledError:  # none announced yet; this one's digest job frees it
                for unsent in pieces[:position] + pieces[position + 1:]:
                    self.release(unsent)
                raise
            view = piece.payload
            if self._faults.corrupt_piece == spec.index and view is not None:
                # After hashing: what a flipped bit on the wire looks like (on a copy when the
                # piece is the cache's own rows, which must stay intact).
                view = view.copy() if piece.buffer is None else view
                view[nbytes // 2] ^= 0xFF
            claimed = nbytes + (self._faults.inflate_piece_bytes if spec.index == 0 else 0)
            entries.append(piece_entry(spec.index, (spec.layer_start, spec.layer_end),
                                       (spec.kv_start, spec.kv_end),
                                       (spec.block_start, spec.block_end), claimed,
                                       piece_digest))
            records.append((spec, nbytes, piece_digest))
            views.append(view)
        reads = transfer.source is not None
        link.send(Kind.PIECE, {"tid": transfer.transfer_id, "pieces": entries, "read": reads})
        if reads:  # the receiver copies them from the exported cache
            transfer.bytes_sent += sum(record[1] for record in records)
            transfer.pieces_sent += len(records)
            return records
        # Every announced piece is sent, even after an abort: the receiver drains it.
        for piece, view in zip(pieces, views, strict=True):
            tag = data_tag(transfer.transfer_id, piece.spec.index)
            task = self._transport.spawn(self._transport.send_payload(link.endpoint, view, tag))
            transfer.sends.add(task)
            task.add_done_callback(lambda done, p=piece: self._sent(transfer, p, done))
        return records

    async def _digest(self, piece: ReadyPiece) -> int:
        """The digest taken during the gather, or (CUDA) one taken now off the loop."""
        if piece.digest is not None:
            return piece.digest
        job = asyncio.ensure_future(self._transport.run_payload(_wait_and_digest,
                                                                piece.payload, piece.event))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda _: self.release(piece))
            raise

    def _sent(self, transfer: OutboundTransfer, piece: ReadyPiece,
              task: asyncio.Task[None]) -> None:
        """Bookkeeping of one payload send (a callback: runs even if cancelled unstarted)."""
        transfer.sends.discard(task)
        if task.cancelled():
            # The peer may still read it: never reuse a staging buffer. (A direct piece's
            # rows go back to the engine; a dead or late peer can read them, never write.)
            if piece.buffer is not None:
                self._pool.quarantine(piece.buffer)
        elif task.exception() is not None:
            self.release(piece)
            transfer.fail(HandoffPeerGoneError(
                f"sending piece {piece.spec.index} failed: {task.exception()}"))
        else:
            transfer.bytes_sent += piece.spec.nbytes(transfer.layout)
            transfer.pieces_sent += 1
            self.release(piece)
        self._on_sent(transfer)

    def release(self, piece: ReadyPiece) -> None:
        if piece.buffer is not None:
            self._pool.release(piece.buffer)

    def _fence_body(self, transfer: OutboundTransfer, fence: FenceRequest,
                    records: list[tuple[PieceSpec, int, int]]) -> dict[str, object]:
        return {"tid": transfer.transfer_id, "num_pieces": len(records),
                "nbytes": sum(r[1] for r in records), "digest": combine_digests(records),
                "first_token_id": fence.first_token_id, "num_tokens": transfer.ticket.num_tokens}


def _wait_and_digest(view: torch.Tensor, event: object) -> int:
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]
    return digest(view)
