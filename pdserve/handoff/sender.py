"""Prefill side of the handoff: push each request's KV, layer by layer as the engine writes it,
into the blocks a decode worker reserved; then the fence; then report when its memory is free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.errors import (
    HandoffCancelledError,
    HandoffError,
    HandoffTimeoutError,
    error_from_code,
)
from pdserve.handoff.faults import SenderFaults
from pdserve.handoff.kvcopy import cache_rows, checked_ids
from pdserve.handoff.outbound import FenceRequest, OutboundTransfer, ReadyPiece
from pdserve.handoff.peers import PeerLink
from pdserve.handoff.piece_plan import (
    choose_plan,
)
from pdserve.handoff.piece_pump import PiecePump
from pdserve.handoff.read_offer import SourceOffer
from pdserve.handoff.staging import StagingPool, StagingStats
from pdserve.handoff.ticket import HandoffTicket
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import (
    Kind,
    WireError,
    peek,
)

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
    num_free_read_slots: int  # of the exported slots region (0 without one)
    num_begun_in_slot: int  # transfers its receiver started from the slot: no BEGIN/SOURCE


class HandoffSender:
    """Pushes KV to receivers over pooled, authenticated links (one per receiver address,
    many transfers multiplexed on it).

    Engine integration: `start_transfer` when a request reaches its final prefill chunk;
    `send_layer` from the compute thread right after each layer's K/V is written (it copies
    the layer's blocks into staging and returns; the network never blocks compute);
    `send_fence` after the step sampled the first token; free the source blocks only when the
    transfer's ``released`` future resolved (deferred free). Thread-safe.
    """

    def __init__(self, transport: HandoffTransport, *, device: torch.device | str = "cpu",
                 faults: SenderFaults | None = None) -> None:
        """``device``: where the KV cache lives (staging buffers are allocated there)."""
        self._transport = transport
        self._config = transport.config
        self._faults = faults or SenderFaults()
        self._pool = StagingPool(self._config.sender_staging_bytes, device)
        self._links: dict[bytes, PeerLink] = {}  # loop only
        self._by_session: dict[int, PeerLink] = {}  # loop only
        self._active: dict[int, OutboundTransfer] = {}  # loop only, by transfer id
        self._counts = {"ok": 0, "failed": 0}
        self._heartbeat: asyncio.Task[None] | None = None
        self._exported: SourceOffer | None = None
        self._last_rows: tuple[object, np.ndarray] | None = None  # see _rows_of
        self._pump = PiecePump(transport, self._pool, self._faults, self._maybe_release)
        transport.register(_ROLE_KINDS, self._on_frame)
        transport.on_shutdown(self._on_shutdown)
        transport.call_soon(self._start_heartbeats)

    # ---- engine API --------------------------------------------------------------------
    def export_cache(self, cache: torch.Tensor) -> bool:
        """Let receivers on this host read ``cache``'s blocks themselves (one copy, no message
        per piece) instead of receiving pushed pieces. Needs the cache in memory from
        `HandoffTransport.share_host_memory`; returns whether it is (else pushes as before)."""
        slots = self._exported.slots if self._exported is not None else None
        self._exported = SourceOffer.export(self._transport, cache, slots)
        return self._exported is not None

    def start_transfer(self, ticket: HandoffTicket, block_ids: Sequence[int], layout: KVLayout,
                       *, layers_per_piece: int | None = None,
                       direct_min_bytes: int | None = None,
                       allow_reads: bool = True, allow_slots: bool = True) -> OutboundTransfer:
        """Begin the handoff of ``block_ids`` (this worker's blocks, in the request's token
        order) to the ticket's reservation. The receiver checks ``layout`` against what it
        reserved. A receiver on this host reads an exported cache itself; others get pushes.

        Overrides (benchmarks, tests): ``layers_per_piece`` forces pieces of that many layers
        (staged ones when pushed); ``direct_min_bytes`` replaces ``config.direct_min_piece_bytes``;
        ``allow_reads=False`` pushes even where the receiver could read; ``allow_slots=False``
        announces read pieces by PIECE frames instead of the shared slots."""
        if len(block_ids) != ticket.num_blocks:
            raise ValueError(f"{len(block_ids)} source blocks for a ticket of {ticket.num_blocks}")
        id_list = [int(b) for b in block_ids]
        source = self._exported
        if not (allow_reads and self._config.same_host_reads and source is not None
                and source.serves(ticket, layout, self._transport.host)):
            source = None
        slot = None
        if source is not None:
            checked = checked_ids(np.asarray(id_list), source.cache_blocks)  # before leasing
            plan, slot = source.plan(ticket, layout, layers_per_piece, allow_slots,
                                     self._faults.corrupt_slot_record)
        else:
            # Direct pieces need host memory on both sides (CUDA caches go through staging).
            runs = ticket.block_runs if self._pool.device.type == "cpu" else ()
            plan = choose_plan(
                layout, id_list, runs, min_piece_bytes=self._config.min_piece_bytes,
                max_piece_bytes=ticket.max_piece_bytes,
                direct_min_bytes=direct_min_bytes or self._config.direct_min_piece_bytes,
                layers_per_piece=layers_per_piece)
        ids = torch.tensor(id_list, dtype=torch.int64, device=self._pool.device)
        transfer = OutboundTransfer(ticket, layout, ids, plan, self._pool,
                                    time.monotonic() + (ticket.deadline - time.time()), source,
                                    slot)
        if source is not None and slot is not None:  # a watching receiver can start now
            slot.publish_begin(source.slot_begin(ticket, layout, checked))
        transfer.queue = asyncio.Queue()  # binds to the handoff loop on first use
        self._transport.call_soon(self._begin, transfer)  # runs before any later call_soon
        return transfer

    def send_layer(self, cache: torch.Tensor, layer: int,
                   transfers: Sequence[OutboundTransfer]) -> None:
        """Compute thread, right after layer ``layer`` (local index) was written: gather that
        layer's blocks for every transfer in ``transfers`` and hand them to the transport."""
        if cache.device != self._pool.device:
            raise ValueError(f"cache on {cache.device}, sender staging on {self._pool.device}: "
                             f"construct HandoffSender(transport, device=cache.device)")
        for transfer in transfers:
            src_rows = None if cache.is_cuda else self._rows_of(cache, transfer.layout)
            for piece in transfer.gather_layer(cache, layer, src_rows):
                self._transport.call_soon(self._enqueue, transfer, piece)

    def _rows_of(self, cache: torch.Tensor, layout: KVLayout) -> np.ndarray:
        """The host cache's numpy byte rows (a view; kept for the next layer's call)."""
        key = (cache.data_ptr(), tuple(cache.shape), cache.dtype, layout)
        last = self._last_rows
        if last is None or last[0] != key:
            last = self._last_rows = (key, cache_rows(cache, layout))
        return last[1]

    def send_all_layers(self, cache: torch.Tensor, transfers: Sequence[OutboundTransfer]) -> None:
        """Every layer at once (the KV already exists, e.g. a full prefix-cache hit)."""
        for layer in range(max((t.layout.num_local_layers for t in transfers), default=0)):
            live = [t for t in transfers if layer < t.layout.num_local_layers]
            self.send_layer(cache, layer, live)

    def send_fence(self, transfer: OutboundTransfer, first_token_id: int) -> None:
        """After every layer was sent: announce completion with the first sampled token."""
        if transfer.request_fence():
            transfer.publish_fence(first_token_id)  # slot transfers: straight to the receiver
        self._transport.call_soon(self._enqueue, transfer, FenceRequest(first_token_id))

    def cancel(self, transfer: OutboundTransfer,
               reason: str = "cancelled by the prefill worker") -> None:
        """Give up the push; ``released`` still resolves only after in-flight sends ended."""
        self._transport.call_soon(self._abort, transfer, HandoffCancelledError(reason))

    def close(self) -> None:
        """Abort every transfer and close links (the transport keeps running). Loop-safe."""
        self._transport.unregister(_ROLE_KINDS, self._on_frame)
        self._transport.remove_shutdown_hook(self._on_shutdown)
        self._transport.call_soon(self._on_shutdown)

    def stats(self) -> SenderStats:
        slots = self._exported.slots if self._exported is not None else None
        return SenderStats(len(self._active), len(self._links), self._counts["ok"],
                           self._counts["failed"], self._pool.stats(),
                           slots.num_free() if slots is not None else 0,
                           self._pump.num_begun_in_slot)

    # ---- loop: per-transfer lifetime -------------------------------------------------------
    def _begin(self, transfer: OutboundTransfer) -> None:
        self._active[transfer.transfer_id] = transfer
        transfer.link = link = self._link_for(transfer.ticket)
        link.transfers.add(transfer)
        delay = max(0.0, transfer.deadline - time.monotonic()) + self._config.send_grace_s
        self._transport.loop.call_later(delay, self._expire, transfer)
        transfer.pump = self._transport.spawn(self._pump.run(transfer, link))
        # A callback, not a finally: it also runs if the task is cancelled before it started.
        transfer.pump.add_done_callback(lambda _: self._close_pump(transfer, link))

    def _link_for(self, ticket: HandoffTicket) -> PeerLink:
        link = self._links.get(ticket.receiver_address)
        if link is None or link.dead is not None:
            link = PeerLink(self._transport, ticket.receiver_address, ticket.receiver_host)
            self._links[ticket.receiver_address] = link
            self._by_session[link.session_id] = link
        return link

    def _enqueue(self, transfer: OutboundTransfer, item: ReadyPiece | FenceRequest) -> None:
        if transfer.pump_done:
            if isinstance(item, ReadyPiece):
                self._pump.release(item)
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
                self._pump.release(item)
        self._maybe_release(transfer)

    def _maybe_release(self, transfer: OutboundTransfer) -> None:
        if not transfer.pump_done or transfer.sends or transfer.released.done():
            return
        if transfer.error is None and not transfer.confirmed:
            return  # all sent; the receiver's DONE (or ABORT, or a dead link) decides
        for buffer in transfer.take_unfinished_buffers():
            self._pool.release(buffer)
        if transfer.source is not None:
            transfer.source.release(transfer.take_slot())
        self._active.pop(transfer.transfer_id, None)
        transfer.link.transfers.discard(transfer)
        result = transfer.result()
        self._counts["ok" if result.ok else "failed"] += 1
        if not result.ok:
            log.info("handoff push of %s ended: %s", transfer.request_id, result.error)
        transfer.released.set_result(result)

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
        if link.dead is not None:
            self._link_down(link)
        transfer = self._active.get(frame.body["tid"]) if frame is not None else None
        if transfer is None or transfer not in link.transfers:
            return
        if kind is Kind.DONE:
            transfer.confirmed = True
            self._maybe_release(transfer)
        elif kind is Kind.ABORT_TO_SENDER:
            assert frame is not None
            cause = error_from_code(frame.body["code"], frame.body["message"])
            self._abort(transfer, type(cause)(f"receiver ended the transfer: {cause}"),
                        from_receiver=True)

    def _link_down(self, link: PeerLink) -> None:
        assert link.dead is not None
        for transfer in list(link.transfers):
            self._abort(transfer, type(link.dead)(str(link.dead)), force=True)
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._by_session.pop(link.session_id, None)

    def _start_heartbeats(self) -> None:
        self._heartbeat = self._transport.spawn(self._heartbeats())

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._config.heartbeat_interval_s)
            now = time.monotonic()
            for link in list(self._links.values()):
                link.ping_if_due(now)
                if link.dead is not None:
                    self._link_down(link)

    def _on_shutdown(self) -> None:
        for transfer in list(self._active.values()):
            self._abort(transfer, HandoffCancelledError("prefill handoff sender shutting down"),
                        force=True)
        for link in list(self._links.values()):
            link.fail(HandoffCancelledError("sender shutting down"))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
