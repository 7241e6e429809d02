"""One request's KV push on the prefill side: the piece plan, the staging buffers the compute
thread gathers into, the pieces deferred until staging has room, and when the transfer may let
go of its source blocks.

Compute-thread methods never wait on the network or on staging; loop-side state is touched only
on the loop. The release rule (`may_release`) is plain state, testable without UCX.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.engine.kv.layout import KVSlice
from pdserve.handoff.device_stream import HandoffStream
from pdserve.handoff.digest import combine_digests
from pdserve.handoff.errors import HandoffError, HandoffProtocolError
from pdserve.handoff.kvcopy import (
    byte_rows,
    cache_rows,
    checked_ids,
    gather_cuda_layer,
    gather_rows,
    piece_view,
)
from pdserve.handoff.plan import PieceSpec
from pdserve.handoff.staging import StagingPool
from pdserve.handoff.ticket import HandoffTicket, SendResult

Record = tuple[PieceSpec, int, int]  # a sent piece's spec, byte count and digest


@dataclass(frozen=True)
class ReadyPiece:
    """A gathered piece handed from the compute thread to the loop, ready to send."""

    spec: PieceSpec
    payload: torch.Tensor  # the piece's bytes at the start of ``buffer``
    buffer: torch.Tensor  # the staging buffer (owned until released)
    event: Any  # torch.cuda.Event recorded after the gather, or None on host memory
    digest: int | None  # xxh3-64 taken during the gather, or None: hash it off the loop


@dataclass(frozen=True)
class DeferredPiece:
    """A piece whose layers were all written while staging was full: the loop gathers it later,
    whole, from the source blocks (pinned until ``released``) once a buffer frees up."""

    spec: PieceSpec
    cache: torch.Tensor
    written: Any  # CUDA: an event on the handoff stream after the piece's last layer; or None


@dataclass(frozen=True)
class FenceRequest:
    first_token_id: int


@dataclass(eq=False)
class OutboundTransfer:
    """Prefill-side handle of one transfer (made by `HandoffSender.start_transfer`).

    Deferred free: ``released`` resolves with a `SendResult` only when no send of this
    transfer is in flight any more (all completed, or aborted because the peer failed or the
    deadline passed) and the outcome is known: the receiver confirmed the fence, or refused
    the transfer, or a local error ended it. Until then the prefill worker must keep the
    source blocks; after it, UCX touches none of this transfer's memory again.
    ``SendResult.error`` is None exactly when the receiver confirmed the KV ready. Its
    callbacks run on the handoff thread: keep them short.
    """

    ticket: HandoffTicket
    kv: KVSlice  # this worker's cache layout, and the KV heads the transfer sends
    block_ids: torch.Tensor
    plan: list[PieceSpec]
    pool: StagingPool
    deadline: float  # time.monotonic()
    stream: HandoffStream | None = None  # CUDA caches: where gathers run (after the engine's)
    released: concurrent.futures.Future[SendResult] = field(
        default_factory=concurrent.futures.Future)
    # compute-thread state, under _lock
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _error: HandoffError | None = None
    _next_layer: int = 0  # layers come in order, each once
    _buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    _hashers: dict[int, Any] = field(default_factory=dict)  # host pieces: piece index -> xxh3
    _ids_np: np.ndarray | None = None  # host block ids, range-checked on first use
    # Backpressure: once one piece found staging full, it and every later piece are deferred
    # (gathered by the loop in order), so no buffer waits behind a piece that waits for one.
    _deferring: bool = False
    _deferred: set[int] = field(default_factory=set)
    _by_layer: dict[int, list[PieceSpec]] = field(default_factory=dict)
    _fence_requested: bool = False
    # loop-side state
    lookahead: DeferredPiece | None = None  # taken off the queue, gathered before what follows
    queue: Any = None  # asyncio.Queue of ReadyPiece | FenceRequest | None (wake-up)
    link: Any = None  # the PeerLink carrying it
    pump: Any = None  # the asyncio task announcing its pieces
    begun: bool = False  # BEGIN went out: the receiver knows this transfer
    receiver_aborted: bool = False  # the receiver ended it (no ABORT back needed)
    confirmed: bool = False  # the receiver said DONE: fence verified
    pump_done: bool = False
    sends: set[Any] = field(default_factory=set)
    bytes_sent: int = 0
    pieces_sent: int = 0

    def __post_init__(self) -> None:
        for spec in self.plan:
            for layer in range(spec.layer_start, spec.layer_end):
                self._by_layer.setdefault(layer, []).append(spec)

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    @property
    def transfer_id(self) -> int:
        return self.ticket.transfer_id

    @property
    def error(self) -> HandoffError | None:
        return self._error  # one attribute read: no lock (the gather may hold it for a while)

    def fail(self, error: HandoffError) -> bool:
        """Record the first error; later gathers become no-ops. Any thread."""
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            return True

    # ---- compute thread ---------------------------------------------------------------
    def gather_layer(self, cache: torch.Tensor, layer: int,
                     src_rows: np.ndarray | None = None) -> list[ReadyPiece | DeferredPiece]:
        """Copy this layer's blocks into the staging buffers of the pieces that hold it and
        return the pieces now complete. ``src_rows``: a host cache's `cache_rows`. Never waits:
        a piece that finds staging full is deferred (returned as a `DeferredPiece` once its
        last layer is written) and the engine carries on. CUDA caches: call inside the
        handoff stream's `after_engine`.

        Holds the transfer's lock while copying, so a transfer ending meanwhile (loop thread)
        takes back its buffers only after the copy finished.
        """
        with self._lock:
            if self._error is not None:
                return []
            if layer != self._next_layer or layer >= self.kv.num_local_layers:
                self._error = HandoffProtocolError(
                    f"layer {layer} sent out of order (expected {self._next_layer})")
                return []
            self._next_layer += 1
            ready: list[ReadyPiece | DeferredPiece] = []
            for spec in self._by_layer.get(layer, ()):
                buffer = self._buffer_for_locked(spec, layer)
                if buffer is None:
                    if layer + 1 == spec.layer_end:
                        self._deferred.discard(spec.index)
                        ready.append(DeferredPiece(spec, cache, self._record()))
                    continue
                if layer == spec.layer_start and not buffer.is_cuda:
                    self._hashers[spec.index] = xxhash.xxh3_64()
                hasher = self._hashers.get(spec.index)
                view = piece_view(buffer, spec, self.kv)
                if src_rows is not None:
                    ids = self._host_ids(src_rows.shape[2])[spec.block_start:spec.block_end]
                    gather_rows(src_rows[layer, spec.kv_start:spec.kv_end], ids,
                                byte_rows(view[layer - spec.layer_start]), self.kv, hasher)
                else:
                    gather_cuda_layer(cache, self.block_ids, spec, layer, self.kv, view)
                if layer + 1 == spec.layer_end:
                    del self._buffers[spec.index]
                    hasher = self._hashers.pop(spec.index, None)
                    ready.append(ReadyPiece(spec, buffer[:spec.nbytes(self.kv)], buffer,
                                            self._record(),
                                            None if hasher is None else hasher.intdigest()))
            return ready

    def gather_piece(self, piece: DeferredPiece, buffer: torch.Tensor) -> ReadyPiece:
        """Payload thread: copy a deferred piece, every layer at once, from its source blocks
        into ``buffer`` (the engine keeps those blocks until ``released``, and their layers
        are final: the engine wrote them before the piece was deferred)."""
        spec, cache = piece.spec, piece.cache
        view = piece_view(buffer, spec, self.kv)
        payload = buffer[:spec.nbytes(self.kv)]
        if cache.is_cuda:
            assert self.stream is not None
            with self.stream.active():  # ordered after ``piece.written`` on the same stream
                for layer in range(spec.layer_start, spec.layer_end):
                    gather_cuda_layer(cache, self.block_ids, spec, layer, self.kv, view)
                return ReadyPiece(spec, payload, buffer, self.stream.record(), None)
        rows = cache_rows(cache, self.kv.layout)
        with self._lock:
            ids = self._host_ids(rows.shape[2])[spec.block_start:spec.block_end]
        hasher = xxhash.xxh3_64()
        for layer in range(spec.layer_start, spec.layer_end):
            gather_rows(rows[layer, spec.kv_start:spec.kv_end], ids,
                        byte_rows(view[layer - spec.layer_start]), self.kv, hasher)
        return ReadyPiece(spec, payload, buffer, None, hasher.intdigest())

    def _record(self) -> Any:
        return None if self.stream is None else self.stream.record()

    def _host_ids(self, num_cache_blocks: int) -> np.ndarray:
        if self._ids_np is None:
            self._ids_np = checked_ids(self.block_ids.numpy(), num_cache_blocks)
        return self._ids_np

    def begin_body(self, digest_kind: str) -> dict[str, Any]:
        """The BEGIN frame's fields: which reservation, and what the pieces will hold."""
        ticket = self.ticket
        return {"tid": ticket.transfer_id, "instance": ticket.receiver_instance,
                "request_id": ticket.request_id, "layout": self.kv.layout.to_dict(),
                "heads": list(ticket.kv.heads), "num_blocks": ticket.num_blocks,
                "digest": digest_kind}

    def fence_body(self, records: list[Record], first_token_id: int) -> dict[str, Any]:
        """The FENCE frame's fields: the counts and digest of every piece announced."""
        return {"tid": self.transfer_id, "num_pieces": len(records),
                "nbytes": sum(r[1] for r in records), "digest": combine_digests(records),
                "first_token_id": first_token_id, "num_tokens": self.ticket.num_tokens}

    def request_fence(self) -> bool:
        """True if every layer was gathered; otherwise the transfer fails (caller bug)."""
        with self._lock:
            if self._fence_requested:
                return False
            self._fence_requested = True
            if self._error is None and self._next_layer != self.kv.num_local_layers:
                self._error = HandoffProtocolError(
                    f"fence requested after {self._next_layer} of "
                    f"{self.kv.num_local_layers} layers")
            return self._error is None

    def take_unfinished_buffers(self) -> list[torch.Tensor]:
        """Buffers of pieces whose layers never all arrived (after the transfer ended)."""
        with self._lock:
            buffers = list(self._buffers.values())
            self._buffers.clear()
            return buffers

    def _buffer_for_locked(self, spec: PieceSpec, layer: int) -> torch.Tensor | None:
        """The piece's buffer, taken at its first layer; None while the piece is deferred."""
        buffer = self._buffers.get(spec.index)
        if buffer is not None or spec.index in self._deferred or layer != spec.layer_start:
            return buffer
        if not self._deferring:
            buffer = self.pool.try_acquire(spec.nbytes(self.kv))
        if buffer is None:
            self._deferring = True
            self._deferred.add(spec.index)
            return None
        self._buffers[spec.index] = buffer
        return buffer

    # ---- loop side ------------------------------------------------------------------------
    def may_release(self) -> bool:
        """Whether ``released`` may resolve now: nothing is queued or in flight, and the outcome
        is known (the receiver confirmed, or the transfer failed)."""
        if not self.pump_done or self.sends or self.released.done():
            return False
        return self.error is not None or self.confirmed

    def result(self) -> SendResult:
        return SendResult(self.request_id, self.transfer_id, self.bytes_sent, self.pieces_sent,
                          self.error, time.monotonic())
