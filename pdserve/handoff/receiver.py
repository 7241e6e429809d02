"""Decode side of the handoff: reserve blocks, accept authenticated pieces into exactly those
blocks, verify the fence, and tell the decode worker when the KV is ready (or why not).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.contract import KVReceiver
from pdserve.handoff.digest import digest_kind
from pdserve.handoff.errors import (
    HandoffCancelledError,
    HandoffError,
    HandoffPeerGoneError,
    HandoffProtocolError,
    HandoffTimeoutError,
    HandoffUnknownTransferError,
    error_from_code,
)
from pdserve.handoff.inbound import InboundState, InboundTransfer
from pdserve.handoff.landing import PieceLanding
from pdserve.handoff.sessions import SenderSession, SessionTable
from pdserve.handoff.staging import StagingPool, StagingStats
from pdserve.handoff.ticket import FenceInfo, HandoffTicket
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.wire import (
    MAX_PIECES,
    PIECES_PER_FRAME,
    Frame,
    Kind,
    WireError,
    data_tag,
    peek,
    piece_header,
)

log = logging.getLogger(__name__)
_ROLE_KINDS = (Kind.HELLO, Kind.PROOF, Kind.BEGIN, Kind.PIECE, Kind.FENCE, Kind.ABORT_TO_RECEIVER,
               Kind.PING)


@dataclass(frozen=True)
class ReceiverStats:
    num_active: int  # reserved or receiving
    num_receiving: int  # a sender began them
    num_ready: int
    num_failed: int
    num_landed_pieces: int  # received into staging, verified and scattered
    num_drained: int  # pieces consumed without landing (their transfer had ended)
    num_refused_peers: int
    num_rejected_frames: int
    staging: StagingStats


class HandoffReceiver(KVReceiver):
    """Owns reservations into one KV cache tensor (``layout.cache_shape(num_blocks)``) and
    implements `KVReceiver` (the contract: who owns the blocks when)."""

    def __init__(self, transport: HandoffTransport, cache: torch.Tensor,
                 layout: KVLayout) -> None:
        expected = layout.cache_shape(cache.shape[2]) if cache.dim() == 6 else None
        if tuple(cache.shape) != expected or cache.dtype != layout.torch_dtype:
            raise ValueError(f"cache {tuple(cache.shape)}/{cache.dtype} does not match layout "
                             f"{layout} (want {expected}/{layout.torch_dtype})")
        if not cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous")
        self._transport, self._cache, self._layout = transport, cache, layout
        self._config = transport.config
        self._pool = StagingPool(self._config.receiver_staging_bytes, cache.device)
        self._landing = PieceLanding(transport, cache, self._pool, self._fail,
                                     self._maybe_ready)
        self._sessions = SessionTable(transport, self._session_failed)
        self._lock = threading.Lock()  # guards the three registries below
        self._by_request: dict[str, InboundTransfer] = {}
        self._by_tid: dict[int, InboundTransfer] = {}
        # Block id -> bit mask of the KV heads (the model's numbering) live transfers may
        # write in it: transfers from several TP ranks fill one block's heads side by side.
        self._writable: dict[int, int] = {}
        self._counts = {"ready": 0, "failed": 0, "rejected": 0}
        self._detach = transport.attach(_ROLE_KINDS, self._on_frame, self._sweep,
                                        self._on_shutdown)

    # ---- decode worker API -------------------------------------------------------------
    def reserve(self, request_id: str, block_ids: Sequence[int], layout: KVLayout,
                num_tokens: int, deadline: float | None = None,
                kv_heads: tuple[int, int] | None = None) -> HandoffTicket:
        self._layout.check_matches(layout)
        kv = KVSlice(layout, kv_heads or layout.kv_heads)
        mask = _head_mask(kv.heads)
        ids = tuple(int(b) for b in block_ids)
        num_cache_blocks = self._cache.shape[2]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= b < num_cache_blocks for b in ids):
            raise ValueError(f"block ids must be unique and within [0, {num_cache_blocks})")
        now = time.time()
        deadline = now + self._config.timeout_s if deadline is None else deadline
        if deadline <= now:
            raise ValueError(f"deadline {deadline} is already past")
        max_piece = min(self._config.max_piece_bytes, self._config.receiver_staging_bytes)
        with self._lock:
            current = self._by_request.get(request_id)
            if current is not None and not current.terminal:
                raise ValueError(f"request {request_id!r} already holds a live reservation")
            clash = [b for b in ids if self._writable.get(b, 0) & mask]
            if clash:
                raise ValueError(f"blocks {sorted(clash)[:8]} are reserved by another transfer "
                                 f"(KV heads {list(kv.heads)})")
            record = InboundTransfer(
                request_id, self._new_transfer_id(), kv,
                torch.tensor(ids, dtype=torch.int64), ids, num_tokens,
                time.monotonic() + (deadline - now), max_piece, self._transport.instance_id,
                digest_kind(self._cache.device))
            ticket = HandoffTicket(
                request_id, record.transfer_id, self._transport.address,
                self._transport.instance_id, self._transport.host, len(ids), num_tokens,
                record.expected_bytes, max_piece, deadline, layout, kv.heads)
            self._by_request[request_id] = record
            self._by_tid[record.transfer_id] = record
            for block in ids:
                self._writable[block] = self._writable.get(block, 0) | mask
        self._transport.call_soon(self._arm_deadline, record)
        return ticket

    def ready_future(self, request_id: str) -> concurrent.futures.Future[FenceInfo]:
        with self._lock:
            record = self._by_request.get(request_id)
        if record is None:
            raise HandoffUnknownTransferError(f"no reservation for request {request_id!r}")
        return record.result

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            record = self._by_request.get(request_id)
        if record is None:
            return False
        error = HandoffCancelledError(f"request {request_id!r} cancelled by the decode worker")
        ended = self._finish(record, error)
        if ended:
            self._transport.call_soon(self._tell_sender, record, error)
        return ended

    def close(self) -> None:
        self._detach()
        self._on_shutdown()

    def writable_block_ids(self) -> frozenset[int]:
        """Blocks that a live transfer may still write into (empty once all have ended)."""
        with self._lock:
            return frozenset(self._writable)

    def stats(self) -> ReceiverStats:
        with self._lock:
            active = sum(not r.terminal for r in self._by_request.values())
            receiving = sum(r.state is InboundState.RECEIVING for r in self._by_request.values())
        return ReceiverStats(active, receiving, self._counts["ready"], self._counts["failed"],
                             self._landing.num_landed, self._landing.num_drained,
                             self._sessions.num_refused, self._counts["rejected"],
                             self._pool.stats())

    # ---- ending a transfer ---------------------------------------------------------------
    def _finish(self, record: InboundTransfer, error: HandoffError | None) -> bool:
        """End ``record`` (any thread): no write into its blocks follows once this returns."""
        with record.write_lock:
            if not record.finish(error, time.monotonic()):
                return False
        with self._lock:
            self._counts["ready" if error is None else "failed"] += 1
            mask = _head_mask(record.kv.heads)
            for block in record.block_id_list:
                left = self._writable.get(block, 0) & ~mask
                if left:
                    self._writable[block] = left
                else:
                    self._writable.pop(block, None)
        record.publish()
        if error is None:
            log.debug("handoff %s ready", record.request_id)
        else:
            log.info("handoff %s failed (%s): %s [%s]", record.request_id, error.code, error,
                     record.progress())
        self._transport.call_soon(self._after_finish, record)
        return True

    def _fail(self, record: InboundTransfer, error: HandoffError) -> None:
        if self._finish(record, error):
            self._tell_sender(record, error)

    def _tell_sender(self, record: InboundTransfer, error: HandoffError) -> None:
        session = self._sessions.get(record.session_id)
        if session is not None and session.key is not None:
            body = {"tid": record.transfer_id, "code": error.code, "message": str(error)}
            self._sessions.send(session, Kind.ABORT_TO_SENDER, body)

    def _after_finish(self, record: InboundTransfer) -> None:
        self._landing.transfer_ended()
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

    # ---- frames from senders (loop) ------------------------------------------------------
    def _on_frame(self, kind: Kind, raw: bytes) -> None:
        """One frame of a receiver-side kind, authenticated, checked against its reservation
        and routed: a bad header fails its transfer (the sender is told), a piece for no live
        transfer is drained."""
        try:
            if kind is Kind.HELLO:
                return self._sessions.on_hello(raw)
            if kind is Kind.PROOF:
                return self._sessions.on_proof(raw)
            frame, session = self._sessions.authenticate(raw, peek(raw)[1])
        except WireError as exc:
            self._counts["rejected"] += 1
            log.warning("rejected a %s frame: %s", kind.name, exc)
            return None
        if kind is Kind.PING:
            self._sessions.send(session, Kind.PONG, {"seq": frame.body["seq"]})
            return None
        record = self._lookup(frame.body["tid"])
        if kind is Kind.BEGIN:
            self._on_begin(record, frame, session)
        elif kind is Kind.PIECE:
            self._on_pieces(record, frame, session)
        elif kind is Kind.FENCE and record is not None and not record.terminal:
            try:
                record.accept_fence(session.session_id, frame.body)
            except HandoffError as exc:
                return self._fail(record, exc)
            self._maybe_ready(record)
        elif (kind is Kind.ABORT_TO_RECEIVER and record is not None and not record.terminal
              and record.session_id == session.session_id):
            cause = error_from_code(frame.body["code"], frame.body["message"])
            self._finish(record, type(cause)(f"sender aborted: {cause}"))
        return None

    def _on_begin(self, record: InboundTransfer | None, frame: Frame,
                  session: SenderSession) -> None:
        tid = frame.body["tid"]
        if record is None or record.terminal:
            reason = (record.error if record is not None and record.error is not None
                      else HandoffUnknownTransferError(f"no live reservation for transfer {tid}"))
            self._sessions.send(session, Kind.ABORT_TO_SENDER,
                                {"tid": tid, "code": reason.code, "message": str(reason)})
            return
        try:
            record.accept_begin(session.session_id, frame.body)
        except HandoffError as exc:
            self._fail(record, exc)
            if record.session_id is None:  # refused before it began: tell this sender
                self._sessions.send(session, Kind.ABORT_TO_SENDER,
                                    {"tid": tid, "code": exc.code, "message": str(exc)})

    def _on_pieces(self, record: InboundTransfer | None, frame: Frame,
                   session: SenderSession) -> None:
        entries = frame.body["pieces"]
        if len(entries) > PIECES_PER_FRAME:
            if record is not None:
                self._fail(record, HandoffProtocolError(
                    f"{len(entries)} pieces in one frame (at most {PIECES_PER_FRAME})"))
            return
        for entry in entries:
            try:
                header = piece_header(entry)
            except WireError as exc:
                if record is not None:
                    self._fail(record, HandoffProtocolError(str(exc)))
                return
            self._on_piece(record, frame.body["tid"], header, session)

    def _on_piece(self, record: InboundTransfer | None, tid: int, header: dict[str, Any],
                  session: SenderSession) -> None:
        """Check one announced piece; receive it (or drain it) right away."""
        index = header["index"]
        if not 0 <= index < MAX_PIECES or not 0 < tid < 1 << 32:
            if record is not None:
                self._fail(record, HandoffProtocolError(f"piece index {index} out of range"))
            return
        tag = data_tag(tid, index)
        if record is None or record.terminal or record.session_id != session.session_id:
            self._landing.drain(tag, session.endpoint)
            return
        try:
            spec = record.accept_piece(session.session_id, header)
        except HandoffError as exc:
            self._fail(record, exc)
            self._landing.drain(tag, session.endpoint)
            return
        self._landing.receive(record, spec, tag, session.endpoint)

    # ---- senders that went away ------------------------------------------------------------
    def _sweep(self) -> None:
        now = time.monotonic()
        for session_id, why in self._sessions.gone(now, self._config.peer_timeout_s).items():
            self._drop_session(session_id, why)
        self._forget_finished(now)

    def _session_failed(self, session_id: int) -> None:
        self._drop_session(session_id, "UCX reports the sender's endpoint failed")

    def _drop_session(self, session_id: int, why: str) -> None:
        """The sender of ``session_id`` is gone: fail its transfers, close its endpoint (which
        cancels the receives posted on it) and forget it."""
        with self._lock:
            records = [r for r in self._by_request.values()
                       if r.session_id == session_id and not r.terminal]
        for record in records:
            self._fail(record, HandoffPeerGoneError(
                f"{why}: handoff of {record.request_id!r} ended ({record.progress()})"))
        self._sessions.drop(session_id)

    def _forget_finished(self, now: float) -> None:
        ttl = self._config.finished_ttl_s
        with self._lock:
            for record in list(self._by_tid.values()):
                if record.finished_at is not None and now - record.finished_at > ttl:
                    del self._by_tid[record.transfer_id]
                    if self._by_request.get(record.request_id) is record:
                        del self._by_request[record.request_id]

    def _on_shutdown(self) -> None:
        with self._lock:
            records = list(self._by_request.values())
        for record in records:
            self._finish(record, HandoffCancelledError("decode handoff receiver shutting down"))

    def _lookup(self, transfer_id: int) -> InboundTransfer | None:
        with self._lock:
            return self._by_tid.get(transfer_id)

    def _new_transfer_id(self) -> int:
        while True:
            tid = int.from_bytes(os.urandom(4), "little")
            if tid and tid not in self._by_tid:
                return tid


def _head_mask(heads: tuple[int, int]) -> int:
    """KV heads ``[start, end)`` as a bit mask."""
    return ((1 << (heads[1] - heads[0])) - 1) << heads[0]
