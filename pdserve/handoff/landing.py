"""Receiver-side piece I/O: wait for staging, receive an accepted piece into it, scatter it into
its reserved blocks while hashing it, verify it; or drain it when its transfer is gone.
Loop only (CUDA scatters run on the payload thread)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch

from pdserve.handoff.device_stream import HandoffStream
from pdserve.handoff.errors import (
    HandoffCapacityError,
    HandoffError,
    HandoffPeerGoneError,
    HandoffProtocolError,
)
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.kvcopy import piece_view, scatter_piece
from pdserve.handoff.plan import PieceSpec
from pdserve.handoff.staging import StagingAdmission, StagingPool
from pdserve.handoff.transport import HandoffTransport

log = logging.getLogger(__name__)
FailFn = Callable[[InboundTransfer, HandoffError], None]
RecordFn = Callable[[InboundTransfer], None]


class PieceLanding:
    """Receives pieces into staging and lands them. Writes into the cache happen only in
    `_land`, under the transfer's ``write_lock`` and only while the transfer is live: once it
    ended, its late pieces are received (or drained) and dropped. Every receive is posted on
    the session's endpoint to its sender, so when that sender is gone and its session is
    dropped, closing the endpoint cancels whatever it left waiting."""

    def __init__(self, transport: HandoffTransport, cache: torch.Tensor, pool: StagingPool,
                 fail: FailFn, landed: RecordFn) -> None:
        self._transport, self._cache, self._pool = transport, cache, pool
        self._admission = StagingAdmission(pool)
        self._stream = HandoffStream(cache.device)
        self._fail, self._landed = fail, landed
        self.num_drained = 0
        self.num_landed = 0

    def receive(self, record: InboundTransfer, spec: PieceSpec, tag: int,
                endpoint: asyncio.Future[Any]) -> None:
        self._transport.spawn(self._receive(record, spec, tag, endpoint))

    def drain(self, tag: int, endpoint: asyncio.Future[Any]) -> None:
        self._transport.spawn(self._drain(tag, endpoint))

    def transfer_ended(self) -> None:
        """Hand queued staging on: waiters of an ended transfer drain instead."""
        self._admission.pump()

    async def _drain(self, tag: int, endpoint: asyncio.Future[Any]) -> None:
        timeout = self._transport.config.timeout_s
        await asyncio.wait_for(self._transport.drain(await endpoint, tag), timeout)
        self.num_drained += 1

    async def _receive(self, record: InboundTransfer, spec: PieceSpec, tag: int,
                       endpoint: asyncio.Future[Any]) -> None:
        import ucxx  # type: ignore[import-untyped]

        nbytes = spec.nbytes(record.kv)
        if not self._pool.fits_ever(nbytes):
            self._fail(record, HandoffCapacityError(f"piece of {nbytes} bytes exceeds staging"))
            return await self._drain(tag, endpoint)
        buffer = await self._admission.acquire(nbytes, lambda: record.terminal)
        if buffer is None:
            return await self._drain(tag, endpoint)
        view = buffer[:nbytes]
        try:
            await self._transport.recv_payload(await endpoint, view, tag)
        except asyncio.CancelledError:
            self._pool.quarantine(buffer)  # UCX may still write into it
            raise
        except ucxx.exceptions.UCXMessageTruncatedError:
            self._admission.release(buffer)
            return self._fail(record, HandoffProtocolError(
                f"piece {spec.index} carries more than the {nbytes} bytes its header said"))
        except Exception as exc:  # noqa: BLE001 - any UCX failure ends this transfer only
            self._admission.release(buffer)
            return self._fail(record, HandoffPeerGoneError(f"piece {spec.index} failed: {exc}"))
        try:
            actual = await self._land_on_device(record, spec, view, buffer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("landing piece %d of %r failed", spec.index, record.request_id)
            return self._fail(record, HandoffError(f"landing piece {spec.index} failed: {exc}"))
        if actual is None:
            self.num_drained += 1
            return None
        try:
            with record.write_lock:
                if not record.terminal:
                    record.check_landed(spec, actual)
        except HandoffError as exc:
            return self._fail(record, exc)
        self.num_landed += 1
        return self._landed(record)

    async def _land_on_device(self, record: InboundTransfer, spec: PieceSpec,
                              view: torch.Tensor, buffer: torch.Tensor) -> int | None:
        """Host pieces land inline (a hash and scatter of ~1-3 ms cost less than two thread
        hops); CUDA ones on the payload thread, which waits for the device. The buffer goes
        back only when that work is over, even if this task is cancelled meanwhile."""
        if not view.is_cuda:
            try:
                return self._land(record, spec, view)
            finally:
                self._admission.release(buffer)
        job = asyncio.ensure_future(self._transport.run_payload(self._land, record, spec, view))
        job.add_done_callback(lambda _: self._admission.release(buffer))
        return await asyncio.shield(job)

    def _land(self, record: InboundTransfer, spec: PieceSpec, view: torch.Tensor) -> int | None:
        """Scatter under the write lock unless the transfer already ended (then None). CUDA:
        on the handoff stream (not behind the engine's forward passes); the digest's read-back
        waits for the scatter, so the blocks are written when this returns."""
        with record.write_lock:
            if record.terminal:
                return None
            if record.device_block_ids is None:
                record.device_block_ids = self._stream.to_device(record.block_id_list)
            staged = piece_view(view, spec, record.kv)
            with self._stream.active():
                return scatter_piece(staged, self._cache, record.device_block_ids, spec,
                                     record.kv)
