"""Decode side of the handoff: reserve blocks, accept authenticated pieces into exactly those
blocks, verify the fence, and tell the decode worker when the KV is ready (or why not).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.errors import (
    HandoffCancelledError,
    HandoffError,
    HandoffPeerGoneError,
    HandoffTimeoutError,
    HandoffUnknownTransferError,
)
from pdserve.handoff.faults import ReceiverFaults
from pdserve.handoff.inbound import InboundState, InboundTransfer
from pdserve.handoff.landing import PieceLanding
from pdserve.handoff.liveness import process_alive
from pdserve.handoff.piece_plan import MAX_TICKET_RUNS, run_lengths
from pdserve.handoff.read_copier import ReadCopier
from pdserve.handoff.receiver_frames import RECEIVER_KINDS, ReceiverFrames
from pdserve.handoff.sessions import SenderSession, SessionTable
from pdserve.handoff.source_reads import SourceMaps
from pdserve.handoff.staging import StagingPool, StagingStats
from pdserve.handoff.ticket import FenceInfo, HandoffTicket
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import (
    Kind,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverStats:
    num_active: int  # reserved or receiving
    num_receiving: int  # a sender began them
    num_ready: int
    num_failed: int
    num_drained: int
    num_direct_pieces: int  # received straight into reserved blocks
    num_staged_pieces: int  # received into staging, then scattered
    num_read_pieces: int  # read from a same-host sender's cache
    num_slotted_transfers: int  # whose read pieces were announced in a shared read slot
    num_slot_begun: int  # of those, begun from the slot before their BEGIN frame arrived
    num_pending_reads: int  # read pieces queued or being copied
    num_refused_peers: int
    num_rejected_frames: int
    staging: StagingStats


class HandoffReceiver:
    """Owns reservations into one KV cache tensor (``layout.cache_shape(num_blocks)``).

    Contract with the decode worker: blocks passed to `reserve` belong to the handoff until
    the ticket ends (ready, failed or cancelled). From that moment the receiver never writes
    into them again and the decode worker frees them (or joins them to its batch); the
    receiver never frees engine blocks itself. All public methods are thread-safe.
    """

    def __init__(self, transport: HandoffTransport, cache: torch.Tensor, layout: KVLayout,
                 *, faults: ReceiverFaults | None = None) -> None:
        expected = layout.cache_shape(cache.shape[2]) if cache.dim() == 6 else None
        if tuple(cache.shape) != expected or cache.dtype != layout.torch_dtype:
            raise ValueError(f"cache {tuple(cache.shape)}/{cache.dtype} does not match layout "
                             f"{layout} (want {expected}/{layout.torch_dtype})")
        if not cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous")
        self._transport, self._cache, self._layout = transport, cache, layout
        self._config = transport.config
        self._faults = faults or ReceiverFaults()
        self._pool = StagingPool(self._config.receiver_staging_bytes, cache.device)
        self._landing = PieceLanding(transport, cache, self._pool, self._faults, self._fail,
                                     self._maybe_ready, self._settle)
        self._sessions = SessionTable(transport)
        self._copier = ReadCopier(cache, self._config.read_threads, self._faults,
                                  self._end_from_thread, self._settle)
        self._sources = SourceMaps(transport, self._copier.on_slot_record,
                                   self._end_from_thread, self._lookup)
        self._lock = threading.Lock()  # guards the three registries below
        self._by_request: dict[str, InboundTransfer] = {}
        self._by_tid: dict[int, InboundTransfer] = {}
        self._writable: set[int] = set()
        self._counts = {"ready": 0, "failed": 0, "rejected": 0, "slotted": 0}
        self._sweeper: asyncio.Task[None] | None = None
        self._frames = ReceiverFrames(self._sessions, self._sources, self._landing,
                                      self._copier, transport.host, self._lookup,
                                      (self._fail, self._finish, self._maybe_ready),
                                      self._counts)
        transport.register(RECEIVER_KINDS, self._frames.on_frame)
        transport.on_shutdown(self._on_shutdown)
        transport.call_soon(self._start_sweeper)

    # ---- decode worker API -------------------------------------------------------------
    def reserve(self, request_id: str, block_ids: Sequence[int], layout: KVLayout,
                num_tokens: int, deadline: float | None = None) -> HandoffTicket:
        """Open a slot for ``request_id``'s KV in ``block_ids`` (any order, any ids).

        ``deadline`` is absolute Unix time (``time.time()``); default: now + default_timeout_s.
        Raises ValueError (LayoutMismatchError for a layout that differs from the cache's).
        """
        self._layout.check_matches(layout)
        ids = tuple(int(b) for b in block_ids)
        num_cache_blocks = self._cache.shape[2]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= b < num_cache_blocks for b in ids):
            raise ValueError(f"block ids must be unique and within [0, {num_cache_blocks})")
        now = time.time()
        deadline = now + self._config.default_timeout_s if deadline is None else deadline
        if deadline <= now:
            raise ValueError(f"deadline {deadline} is already past")
        max_piece = min(self._config.max_piece_bytes, self._config.receiver_staging_bytes)
        runs = run_lengths(ids) if not self._cache.is_cuda else []  # CUDA: staged pieces only
        reads = self._config.same_host_reads and not self._cache.is_cuda
        block_runs = tuple(runs) if len(runs) <= MAX_TICKET_RUNS else ()
        with self._lock:
            current = self._by_request.get(request_id)
            if current is not None and not current.terminal:
                raise ValueError(f"request {request_id!r} already holds a live reservation")
            clash = self._writable.intersection(ids)
            if clash:
                raise ValueError(f"blocks {sorted(clash)[:8]} are reserved by another transfer")
            record = InboundTransfer(
                request_id, self._new_transfer_id(), layout,
                torch.tensor(ids, dtype=torch.int64, device=self._cache.device), ids, num_tokens,
                time.monotonic() + (deadline - now), max_piece, self._transport.instance_id,
                reads_offered=reads)
            ticket = HandoffTicket(
                request_id, record.transfer_id, self._transport.address,
                self._transport.instance_id, self._transport.host, len(ids), num_tokens,
                record.expected_bytes, max_piece, deadline, layout, block_runs, reads)
            self._by_request[request_id] = record
            self._by_tid[record.transfer_id] = record
            self._writable.update(ids)
        self._transport.call_soon(self._arm_deadline, record)
        return ticket

    def ready_future(self, request_id: str) -> concurrent.futures.Future[FenceInfo]:
        """Resolves with the `FenceInfo` once ready, or raises the `HandoffError` that ended it."""
        with self._lock:
            record = self._by_request.get(request_id)
        if record is None:
            raise HandoffUnknownTransferError(f"no reservation for request {request_id!r}")
        return record.result

    def wait_ready(self, request_id: str, timeout: float | None = None) -> FenceInfo:
        """Block until ready. Raises a `HandoffError` if the transfer ended otherwise, or the
        builtin TimeoutError if only this wait timed out (the transfer then goes on)."""
        try:
            return self.ready_future(request_id).result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"request {request_id!r} not ready within {timeout}s") from None

    async def wait_ready_async(self, request_id: str, timeout: float | None = None) -> FenceInfo:
        """`wait_ready` for asyncio code (any event loop)."""
        future = asyncio.wrap_future(self.ready_future(request_id))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise TimeoutError(f"request {request_id!r} not ready within {timeout}s") from None

    def cancel(self, request_id: str) -> bool:
        """End the transfer now; on return nothing writes into its blocks any more (a direct
        write UCX already started, a copy of at most one piece, is waited for). Returns whether
        this call ended it. Raises `HandoffError` with ``blocks_released=False`` if a write
        did not end within ``peer_timeout_s``: the blocks must then never be reused."""
        with self._lock:
            record = self._by_request.get(request_id)
        if record is None:
            return False
        error = HandoffCancelledError(f"request {request_id!r} cancelled by the decode worker")
        ended = self._finish(record, error)
        if ended:
            self._transport.call_soon(self._tell_sender, record, error, None)
        if self._transport.on_loop_thread():
            return ended
        # The write watchdog settles by peer_timeout_s at the latest; wait a little longer.
        settled = record.settled.wait(self._config.peer_timeout_s + 1.0)
        if not settled or (record.error is not None and not record.error.blocks_released):
            raise record.error if settled and record.error is not None else HandoffError(
                f"request {request_id!r}: a KV write into its blocks did not end after the "
                f"cancel", blocks_released=False)
        return ended

    def close(self) -> None:
        """Cancel every live transfer and stop handling frames (the transport keeps running)."""
        self._transport.unregister(RECEIVER_KINDS, self._frames.on_frame)
        self._transport.remove_shutdown_hook(self._on_shutdown)
        self._on_shutdown()
        if self._sweeper is not None:
            self._transport.call_soon(self._sweeper.cancel)

    def writable_block_ids(self) -> frozenset[int]:
        """Blocks that a live transfer may still write into (empty once all have ended)."""
        with self._lock:
            return frozenset(self._writable)

    def stats(self) -> ReceiverStats:
        with self._lock:
            active = sum(not r.terminal for r in self._by_request.values())
            receiving = sum(r.state is InboundState.RECEIVING for r in self._by_request.values())
        return ReceiverStats(active, receiving, self._counts["ready"], self._counts["failed"],
                             self._landing.num_drained + self._copier.num_dropped,
                             self._landing.num_direct, self._landing.num_staged,
                             self._copier.num_read,
                             self._counts["slotted"] + self._sources.num_slot_begun,
                             self._sources.num_slot_begun,
                             self._copier.num_pending,
                             self._sessions.num_refused,
                             self._counts["rejected"], self._pool.stats())

    # ---- ending a transfer ---------------------------------------------------------------
    def _finish(self, record: InboundTransfer, error: HandoffError | None) -> bool:
        with record.write_lock:
            if not record.finish(error, time.monotonic()):
                return False
            quiet = record.writes_in_flight == 0
        with self._lock:
            self._counts["ready" if error is None else "failed"] += 1
        if quiet:
            self._settle(record)
        else:
            self._transport.call_soon(self._arm_write_watchdog, record)
        if error is None:
            log.debug("handoff %s ready", record.request_id)
        else:
            log.info("handoff %s failed (%s): %s [%s]", record.request_id, error.code, error,
                     record.progress())
        self._transport.call_soon(self._after_finish, record)
        return True

    def _settle(self, record: InboundTransfer) -> None:
        """The transfer ended and nothing writes into its blocks: hand them back."""
        with self._lock:
            self._writable.difference_update(record.block_id_list)
        record.settle()

    def _arm_write_watchdog(self, record: InboundTransfer) -> None:
        self._transport.loop.call_later(self._config.peer_timeout_s, self._abandon, record)

    def _abandon(self, record: InboundTransfer) -> None:
        """A direct write outlived its transfer by ``peer_timeout_s``: its sender stopped
        mid-message (over shared memory, without endpoint error handling, UCX never fails
        such a receive). If that sender was a process on this host and it is gone, nothing
        can feed the receive any more: the blocks are released. Otherwise UCX might still
        write, so they are given up, never handed back: they stay in `writable_block_ids`
        and the outcome says ``blocks_released=False``."""
        if record.sender_pid is not None and not process_alive(record.sender_pid):
            log.info("handoff %s: sender process %d is gone; its %d stalled write(s) can "
                     "never resume", record.request_id, record.sender_pid,
                     record.writes_in_flight)
            return self._settle(record)
        with record.write_lock:
            if record.settled.is_set() or record.writes_in_flight == 0:
                return None
            cause = record.error or HandoffCancelledError("ended")
            record.error = type(cause)(
                f"{cause}; a KV write into its blocks is still in flight, so they must not be "
                f"reused", blocks_released=False)
        log.error("handoff %s: %d write(s) still in flight %.1fs after it ended; its %d "
                  "blocks are quarantined", record.request_id, record.writes_in_flight,
                  self._config.peer_timeout_s, record.num_blocks)
        record.settle()
        return None

    def _fail(self, record: InboundTransfer, error: HandoffError,
              session: SenderSession | None = None) -> None:
        if self._finish(record, error):
            self._tell_sender(record, error, session)

    def _end_from_thread(self, record: InboundTransfer, error: HandoffError | None) -> None:
        """A read thread's outcome: ready (fence verified, every piece landed) or failed."""
        if self._finish(record, error) and error is not None:
            self._transport.call_soon(self._tell_sender, record, error, None)

    def _tell_sender(self, record: InboundTransfer, error: HandoffError,
                     session: SenderSession | None) -> None:
        target = session or self._sessions.get(record.session_id)
        if target is not None and target.key is not None:
            body = {"tid": record.transfer_id, "code": error.code, "message": str(error)}
            self._sessions.send(target, Kind.ABORT_TO_SENDER, body)

    def _after_finish(self, record: InboundTransfer) -> None:
        self._landing.transfer_ended(record)
        session = self._sessions.get(record.session_id)
        if record.state is InboundState.READY and session is not None:
            self._sessions.send(session, Kind.DONE, {"tid": record.transfer_id})

    def _arm_deadline(self, record: InboundTransfer) -> None:
        self._transport.loop.call_later(max(0.0, record.deadline - time.monotonic()),
                                         self._expire, record)

    def _expire(self, record: InboundTransfer) -> None:
        if not record.terminal:
            self._fail(record, HandoffTimeoutError(
                f"handoff of {record.request_id!r} missed its deadline ({record.progress()})"))

    def _maybe_ready(self, record: InboundTransfer) -> None:
        with record.write_lock:
            complete = not record.terminal and record.completion() is not None
        if complete:
            self._finish(record, None)

    # ---- housekeeping ----------------------------------------------------------------------
    def _start_sweeper(self) -> None:
        self._sweeper = self._transport.spawn(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._config.heartbeat_interval_s)
            now = time.monotonic()
            silent = set(self._sessions.silent(now, self._config.peer_timeout_s))
            with self._lock:
                records = list(self._by_request.values())
            busy = set()
            for record in records:
                if record.state is InboundState.RECEIVING and record.session_id in silent:
                    self._fail(record, HandoffPeerGoneError(
                        f"sender of {record.request_id!r} silent for over "
                        f"{self._config.peer_timeout_s}s ({record.progress()})"))
                elif not record.terminal and record.session_id is not None:
                    busy.add(record.session_id)
            for session_id in silent - busy:
                self._sessions.drop(session_id)
                self._sources.forget(session_id)
            self._forget_finished(records, now)

    def _forget_finished(self, records: list[InboundTransfer], now: float) -> None:
        ttl = self._config.finished_ttl_s
        with self._lock:
            for record in records:
                if record.finished_at is not None and now - record.finished_at > ttl:
                    if self._by_request.get(record.request_id) is record:
                        del self._by_request[record.request_id]
                    self._by_tid.pop(record.transfer_id, None)

    def _on_shutdown(self) -> None:
        with self._lock:
            records = list(self._by_request.values())
        for record in records:
            self._finish(record, HandoffCancelledError("decode handoff receiver shutting down"))
        self._sources.forget_all()
        self._copier.close()

    def _lookup(self, transfer_id: int) -> InboundTransfer | None:
        with self._lock:
            return self._by_tid.get(transfer_id)

    def _new_transfer_id(self) -> int:
        while True:
            tid = int.from_bytes(os.urandom(4), "little")
            if tid and tid not in self._by_tid:
                return tid

