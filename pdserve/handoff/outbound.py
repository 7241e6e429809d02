"""One request's KV push on the prefill side: the piece plan, the staging buffers the compute
thread gathers into (or the cache rows direct pieces go from), and the completion signal.

Compute-thread methods never wait on the network; loop-side state is touched only on the loop.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.errors import HandoffCapacityError, HandoffError, HandoffProtocolError
from pdserve.handoff.kvcopy import (
    byte_rows,
    checked_ids,
    combine_digests,
    digest_rows,
    gather_piece,
    gather_rows,
    joint_runs,
    piece_view,
    row_span,
)
from pdserve.handoff.piece_plan import PieceSpec, is_run
from pdserve.handoff.read_offer import SourceOffer
from pdserve.handoff.read_slots import SlotLease, fence_record, piece_record
from pdserve.handoff.staging import StagingPool
from pdserve.handoff.ticket import HandoffTicket, SendResult


@dataclass(frozen=True)
class ReadyPiece:
    """A piece handed from the compute thread to the loop, ready to send (or to announce, for
    a receiver that reads it itself: no payload then)."""

    spec: PieceSpec
    payload: torch.Tensor | np.ndarray | None  # contiguous bytes: staging or the cache's rows
    buffer: torch.Tensor | None  # the staging buffer (owned until released); None: direct
    event: Any  # torch.cuda.Event recorded after the gather, or None on host memory
    digest: int | None  # xxh3-64 taken during the gather, or None: hash it off-thread


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
    ``SendResult.error`` is None exactly when the receiver confirmed the KV ready. Callbacks
    added with `add_done_callback` run on the handoff thread: keep them short. From asyncio:
    ``await asyncio.wrap_future(transfer.released)``.
    """

    ticket: HandoffTicket
    layout: KVLayout
    block_ids: torch.Tensor
    plan: list[PieceSpec]
    pool: StagingPool
    deadline: float  # time.monotonic()
    source: SourceOffer | None = None  # set: the receiver reads the pieces, nothing is sent
    slot: SlotLease | None = None  # set: read pieces and the fence are announced in this slot
    released: concurrent.futures.Future[SendResult] = field(
        default_factory=concurrent.futures.Future)
    # compute-thread state, under _lock
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _error: HandoffError | None = None
    _layers_done: set[int] = field(default_factory=set)
    _buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    _gathered_layers: dict[int, int] = field(default_factory=dict)
    _hashers: dict[int, Any] = field(default_factory=dict)  # piece index -> xxh3 or None
    _out_rows: dict[int, np.ndarray] = field(default_factory=dict)  # host piece byte views
    _ids_np: np.ndarray | None = None  # host block ids, range-checked on first use
    _by_layer: dict[int, list[PieceSpec]] = field(default_factory=dict)
    _direct_first: dict[int, int] = field(default_factory=dict)  # piece -> first source block
    _fence_requested: bool = False
    _published: list[tuple[PieceSpec, int, int]] = field(default_factory=list)  # slot records
    _read_runs: list[tuple[int, int]] | None = None  # runs of the block ids, for digest_rows
    # loop-side state
    queue: Any = None  # asyncio.Queue of ReadyPiece | FenceRequest | None (wake-up)
    link: Any = None  # the PeerLink carrying it
    pump: Any = None  # the asyncio task announcing its pieces
    begun: bool = False  # BEGIN went out: the receiver knows this transfer
    receiver_aborted: bool = False  # the receiver ended it (no ABORT back needed)
    confirmed: bool = False  # the receiver said DONE: fence verified
    pump_done: bool = False
    sends: set[Any] = field(default_factory=set)
    bytes_sent: int = 0  # (slot transfers: counted by the compute thread as it publishes)
    pieces_sent: int = 0

    def __post_init__(self) -> None:
        ids = self.block_ids.tolist()
        host = self.block_ids.device.type == "cpu"
        for spec in self.plan:
            for layer in range(spec.layer_start, spec.layer_end):
                self._by_layer.setdefault(layer, []).append(spec)
            rows = ids[spec.block_start:spec.block_end]
            if host and spec.is_single_row and is_run(rows):
                self._direct_first[spec.index] = rows[0]

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    @property
    def transfer_id(self) -> int:
        return self.ticket.transfer_id

    @property
    def error(self) -> HandoffError | None:
        return self._error  # one attribute read: no lock (the gather may hold it for a while)

    def add_done_callback(self, fn: Callable[[SendResult], None]) -> None:
        self.released.add_done_callback(lambda future: fn(future.result()))

    def fail(self, error: HandoffError) -> bool:
        """Record the first error; later gathers become no-ops. Any thread."""
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            return True

    # ---- compute thread ---------------------------------------------------------------
    def gather_layer(self, cache: torch.Tensor, layer: int,
                     src_rows: np.ndarray | None = None) -> list[ReadyPiece]:
        """Copy this layer's blocks into the staging buffers of the pieces that hold it and
        return the pieces now complete. Never waits on the network; on a full staging pool the
        transfer fails with `HandoffCapacityError` and the engine carries on.

        Holds the transfer's lock while copying, so a transfer ending meanwhile (loop thread)
        takes back its buffers only after the copy finished.
        """
        with self._lock:
            if self._error is not None:
                return []
            if not 0 <= layer < self.layout.num_local_layers or layer in self._layers_done:
                self._error = HandoffProtocolError(f"layer {layer} sent twice or out of range")
                return []
            self._layers_done.add(layer)
            if self.source is not None:
                return self._read_layer_locked(cache, layer, src_rows)
            ready: list[ReadyPiece] = []
            for spec in self._by_layer.get(layer, ()):
                first = self._direct_first.get(spec.index)
                if first is not None and src_rows is not None:
                    payload = row_span(src_rows, spec, first)
                    ready.append(ReadyPiece(spec, payload, None, None,
                                            xxhash.xxh3_64_intdigest(payload)))
                    continue
                buffer = self._buffer_for_locked(spec)
                if buffer is None:
                    return ready  # the loop releases these: the transfer has failed
                done = self._gathered_layers.get(spec.index, 0)
                hasher = self._hasher_for(spec, layer, done, buffer)
                if src_rows is not None:  # host: precomputed views, no per-layer torch calls
                    out_rows = self._out_rows[spec.index][layer - spec.layer_start]
                    ids = self._host_ids(src_rows.shape[2])
                    gather_rows(src_rows[layer, spec.kv_start:spec.kv_end],
                                ids[spec.block_start:spec.block_end], out_rows, hasher)
                else:
                    gather_piece(cache, self.block_ids, spec, self.layout,
                                 piece_view(buffer, spec, self.layout), [layer], hasher)
                self._gathered_layers[spec.index] = done + 1
                if done + 1 == spec.num_layers:
                    del self._buffers[spec.index]
                    self._out_rows.pop(spec.index, None)
                    hasher = self._hashers.pop(spec.index, None)
                    ready.append(ReadyPiece(spec, buffer[:spec.nbytes(self.layout)], buffer,
                                            _record_event(buffer),
                                            None if hasher is None else hasher.intdigest()))
            return ready

    def _read_layer_locked(self, cache: torch.Tensor, layer: int,
                           src_rows: np.ndarray | None) -> list[ReadyPiece]:
        """Pieces the receiver reads itself: only their digest is taken, once their last
        layer is written (the receiver copies straight from these rows)."""
        assert self.source is not None
        if src_rows is None or cache.data_ptr() != self.source.cache.data_ptr():
            self._error = HandoffProtocolError(
                "send_layer got another cache than the exported one this transfer reads from")
            return []
        ready = []
        for spec in self._by_layer.get(layer, ()):
            done = self._gathered_layers.get(spec.index, 0) + 1
            self._gathered_layers[spec.index] = done
            if done == spec.num_layers:
                ids = self._host_ids(src_rows.shape[2])
                if self._read_runs is None:
                    self._read_runs = joint_runs(ids)
                piece_digest = digest_rows(src_rows, ids, spec, self._read_runs)
                if self.slot is None:
                    ready.append(ReadyPiece(spec, None, None, None, piece_digest))
                else:  # announced here and now: no hop through the loop, no frame
                    self._publish_locked(spec, piece_digest)
        return ready

    def _publish_locked(self, spec: PieceSpec, piece_digest: int) -> None:
        assert self.slot is not None
        nbytes = spec.nbytes(self.layout)
        self.slot.publish(len(self._published),
                          piece_record(spec, nbytes, piece_digest, self.slot.tag))
        self._published.append((spec, nbytes, piece_digest))
        self.bytes_sent += nbytes
        self.pieces_sent += 1

    def publish_fence(self, first_token_id: int) -> None:
        """Slot transfers: announce the fence in the slot (after `request_fence` passed)."""
        with self._lock:
            if self.slot is None or self._error is not None:
                return
            records = self._published
            self.slot.publish(len(records), fence_record(
                len(records), sum(r[1] for r in records), combine_digests(records),
                first_token_id, self.ticket.num_tokens, self.slot.tag))

    def take_slot(self) -> SlotLease | None:
        """End publishing (the transfer was released): the slot goes back to its table."""
        with self._lock:
            slot, self.slot = self.slot, None
            return slot

    def _host_ids(self, num_cache_blocks: int) -> np.ndarray:
        if self._ids_np is None:
            self._ids_np = checked_ids(self.block_ids.numpy(), num_cache_blocks)
        return self._ids_np

    def _hasher_for(self, spec: PieceSpec, layer: int, done: int, buffer: torch.Tensor) -> Any:
        """Hash while gathering (host, layers in order); else None: hashed later off-thread."""
        if done == 0:
            in_order = layer == spec.layer_start and not buffer.is_cuda
            self._hashers[spec.index] = xxhash.xxh3_64() if in_order else None
        elif self._hashers.get(spec.index) is not None and layer != spec.layer_start + done:
            self._hashers[spec.index] = None
        return self._hashers.get(spec.index)

    def request_fence(self) -> bool:
        """True if every layer was gathered; otherwise the transfer fails (caller bug)."""
        with self._lock:
            if self._fence_requested:
                return False
            self._fence_requested = True
            if self._error is None and len(self._layers_done) != self.layout.num_local_layers:
                self._error = HandoffProtocolError(
                    f"fence requested after {len(self._layers_done)} of "
                    f"{self.layout.num_local_layers} layers")
            return self._error is None

    def take_unfinished_buffers(self) -> list[torch.Tensor]:
        """Buffers of pieces whose layers never all arrived (after the transfer ended)."""
        with self._lock:
            buffers = list(self._buffers.values())
            self._buffers.clear()
            return buffers

    def _buffer_for_locked(self, spec: PieceSpec) -> torch.Tensor | None:
        buffer = self._buffers.get(spec.index)
        if buffer is None:
            buffer = self.pool.try_acquire(spec.nbytes(self.layout))
            if buffer is None:
                stats = self.pool.stats()
                self._error = HandoffCapacityError(
                    f"sender staging full ({stats.in_use_bytes} of {stats.capacity_bytes} bytes "
                    f"in use); dropping the handoff of {self.request_id!r}")
                return None
            self._buffers[spec.index] = buffer
            if not buffer.is_cuda:
                self._out_rows[spec.index] = byte_rows(piece_view(buffer, spec, self.layout))
        return buffer

    # ---- loop side ------------------------------------------------------------------------
    def result(self) -> SendResult:
        return SendResult(self.request_id, self.transfer_id, self.bytes_sent, self.pieces_sent,
                          self.error, time.monotonic())


def _record_event(buffer: torch.Tensor) -> Any:
    if not buffer.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event
