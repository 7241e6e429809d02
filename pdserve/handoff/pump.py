"""Prefill side, loop thread: one task per transfer that sends BEGIN, announces and sends its
pieces in order as the compute thread queues them, then the fence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from pdserve.handoff.digest import combine_digests, digest, digest_kind
from pdserve.handoff.errors import HandoffError, HandoffPeerGoneError
from pdserve.handoff.outbound import FenceRequest, OutboundTransfer, ReadyPiece
from pdserve.handoff.peers import PeerLink
from pdserve.handoff.plan import PieceSpec
from pdserve.handoff.staging import StagingPool
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import PIECES_PER_FRAME, Kind, data_tag, piece_entry

Record = tuple[PieceSpec, int, int]  # spec, byte count, digest


class PiecePump:
    """Announces and sends one transfer's pieces. Every announced piece is sent, even after an
    abort (the receiver drains it), so the receiver never waits on a piece that cannot come;
    ``on_sent(transfer)`` runs after each payload send, for the sender to see whether the
    transfer is over."""

    def __init__(self, transport: HandoffTransport, pool: StagingPool,
                 on_sent: Callable[[OutboundTransfer], None]) -> None:
        self._transport, self._pool = transport, pool
        self._on_sent = on_sent

    async def run(self, transfer: OutboundTransfer, link: PeerLink) -> None:
        """BEGIN, then pieces in order, then the fence. Exits on fence or on error."""
        try:
            await link.ready
            ticket = transfer.ticket
            link.send(Kind.BEGIN, {"tid": ticket.transfer_id, "instance": ticket.receiver_instance,
                                   "request_id": ticket.request_id,
                                   "layout": transfer.layout.to_dict(),
                                   "num_blocks": ticket.num_blocks,
                                   "digest": digest_kind(self._pool.device)})
            transfer.begun = True
            records: list[Record] = []
            while transfer.error is None:
                pieces, last = await self._next_items(transfer)
                if transfer.error is not None:
                    for piece in pieces:
                        self.release(piece)
                    break
                if pieces:
                    records.extend(await self._announce(transfer, link, pieces))
                if isinstance(last, FenceRequest):
                    link.send(Kind.FENCE, {
                        "tid": transfer.transfer_id, "num_pieces": len(records),
                        "nbytes": sum(r[1] for r in records), "digest": combine_digests(records),
                        "first_token_id": last.first_token_id,
                        "num_tokens": transfer.ticket.num_tokens})
                    break
                if last is None and not pieces:
                    break  # woken to stop
        except HandoffError as exc:
            transfer.fail(exc)

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
                        pieces: list[ReadyPiece]) -> list[Record]:
        """One PIECE frame for ``pieces``, then their payload sends."""
        records, entries = [], []
        for position, piece in enumerate(pieces):
            spec, nbytes = piece.spec, piece.spec.nbytes(transfer.layout)
            try:
                piece_digest = await self._digest(piece)
            except asyncio.CancelledError:  # none announced yet; this one's digest job frees it
                for unsent in pieces[:position] + pieces[position + 1:]:
                    self.release(unsent)
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
            self._pool.quarantine(piece.buffer)  # the peer may still read it: never reuse
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
        self._pool.release(piece.buffer)


def _wait_and_digest(view: torch.Tensor, event: object) -> int:
    if event is not None:
        event.synchronize()  # type: ignore[attr-defined]
    return digest(view)
