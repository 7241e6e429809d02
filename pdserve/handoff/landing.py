"""Receiver-side piece I/O: receive an accepted piece straight into its reserved blocks
(direct) or into staging and scatter it; verify it; or drain it when its transfer is gone.
Loop only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch
import xxhash

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.admission import StagingAdmission
from pdserve.handoff.errors import (
    HandoffCapacityError,
    HandoffError,
    HandoffPeerGoneError,
    HandoffProtocolError,
)
from pdserve.handoff.faults import ReceiverFaults
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.kvcopy import (
    cache_rows,
    digest_and_scatter,
    piece_view,
    row_span,
)
from pdserve.handoff.piece_plan import PieceSpec, is_run
from pdserve.handoff.staging import StagingPool
from pdserve.handoff.transport import HandoffTransport

log = logging.getLogger(__name__)
FailFn = Callable[[InboundTransfer, HandoffError], None]
RecordFn = Callable[[InboundTransfer], None]


class PieceLanding:
    """Tracks every piece task by transfer id so a failed transfer's leftovers can be reaped.

    Writes into the cache happen only in `_land` (on the loop for host memory: a piece's hash
    and scatter take ~1-3 ms, less than the two thread hops of the payload thread cost; on
    the payload thread for CUDA, which waits on the device), under the
    transfer's ``write_lock`` and only while the transfer is live: once a transfer ended,
    its late pieces are received into staging (or drained) and dropped.
    """

    def __init__(self, transport: HandoffTransport, cache: torch.Tensor, pool: StagingPool,
                 faults: ReceiverFaults, fail: FailFn, landed: RecordFn,
                 settle: RecordFn) -> None:
        self._transport, self._cache, self._pool = transport, cache, pool
        self._admission = StagingAdmission(pool)
        self._faults, self._fail, self._landed, self._settle = faults, fail, landed, settle
        self._rows: dict[KVLayout, np.ndarray] = {}  # host cache byte views, per layout
        self._tasks: dict[int, set[asyncio.Task[None]]] = {}
        self.num_drained = 0
        self.num_direct = 0  # pieces received straight into their blocks
        self.num_staged = 0  # pieces received into staging and scattered

    def receive(self, record: InboundTransfer, spec: PieceSpec, tag: int) -> None:
        rows = record.block_id_list[spec.block_start:spec.block_end]
        if spec.is_single_row and not self._cache.is_cuda and is_run(rows):
            self._track(record.transfer_id, self._receive_direct(record, spec, tag, rows[0]))
        else:
            self._track(record.transfer_id, self._receive(record, spec, tag))

    def drain(self, transfer_id: int, tag: int) -> None:
        self._track(transfer_id, self._drain(tag))

    def transfer_ended(self, record: InboundTransfer) -> None:
        """Hand queued staging to others; give a live sender time to send what it announced
        (drained on arrival), then stop waiting on a dead one."""
        self._admission.pump()
        if record.error is not None and self._tasks.get(record.transfer_id):
            self._transport.loop.call_later(self._transport.config.peer_timeout_s, self._reap,
                                            record.transfer_id)

    def _reap(self, transfer_id: int) -> None:
        for task in list(self._tasks.get(transfer_id, ())):
            task.cancel()

    def _track(self, transfer_id: int, coro: Coroutine[Any, Any, None]) -> None:
        task = self._transport.spawn(coro)
        bucket = self._tasks.setdefault(transfer_id, set())
        bucket.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            bucket.discard(finished)
            if not bucket and self._tasks.get(transfer_id) is bucket:
                del self._tasks[transfer_id]
        task.add_done_callback(done)

    async def _drain(self, tag: int) -> None:
        timeout = self._transport.config.default_timeout_s
        await asyncio.wait_for(self._transport.drain(tag), timeout)
        self.num_drained += 1

    async def _receive_direct(self, record: InboundTransfer, spec: PieceSpec, tag: int,
                              first_block: int) -> None:
        """Probe, then receive into the blocks themselves: a receive is only ever started for
        a message that has arrived, under the write lock of a live transfer, so ending the
        transfer waits at most for copies already running (see `InboundTransfer`)."""
        if self._faults.recv_delay_s:
            await asyncio.sleep(self._faults.recv_delay_s)
        probe = await self._transport.probe(tag, lambda: record.terminal)
        if probe is None:
            return await self._drain(tag)
        nbytes = spec.nbytes(record.layout)
        if probe.length != nbytes:
            self._fail(record, HandoffProtocolError(
                f"piece {spec.index} carries {probe.length} bytes, its header said {nbytes}"))
        with record.write_lock:
            started = record.begin_direct_write()
        if not started:
            await self._transport.drain_probed(probe)
            self.num_drained += 1
            return None
        view = row_span(self._rows_for(record.layout), spec, first_block)
        write = self._transport.recv_probed(view, probe)
        write.add_done_callback(lambda _: self._direct_write_ended(record))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any UCX failure ends this transfer only
            return self._fail(record, HandoffPeerGoneError(f"piece {spec.index} failed: {exc}"))
        self.num_direct += 1
        return self._verify(record, spec, xxhash.xxh3_64_intdigest(view))

    def _rows_for(self, layout: KVLayout) -> np.ndarray:
        rows = self._rows.get(layout)
        if rows is None:
            rows = self._rows[layout] = cache_rows(self._cache, layout)
        return rows

    def _direct_write_ended(self, record: InboundTransfer) -> None:
        with record.write_lock:
            last = record.end_direct_write()
        if last:
            self._settle(record)

    async def _receive(self, record: InboundTransfer, spec: PieceSpec, tag: int) -> None:
        nbytes = spec.nbytes(record.layout)
        if not self._pool.fits_ever(nbytes):
            self._fail(record, HandoffCapacityError(f"piece of {nbytes} bytes exceeds staging"))
            return await self._drain(tag)
        buffer = await self._admission.acquire(nbytes, lambda: record.terminal)
        if buffer is None:
            return await self._drain(tag)
        view = buffer[:nbytes]
        try:
            if self._faults.recv_delay_s:
                await asyncio.sleep(self._faults.recv_delay_s)
            await self._transport.recv_payload(view, tag)
        except asyncio.CancelledError:
            self._pool.quarantine(buffer)  # UCX may still write into it
            raise
        except Exception as exc:  # noqa: BLE001 - any UCX failure ends this transfer only
            self._admission.release(buffer)
            return self._fail(record, HandoffPeerGoneError(f"piece {spec.index} failed: {exc}"))
        # The payload thread keeps using the buffer even if this task is cancelled: release it
        # only when that work is over. Host pieces land inline (no await: nothing to cancel).
        try:
            if view.is_cuda:
                job = asyncio.ensure_future(
                    self._transport.run_payload(self._land, record, spec, view))
                job.add_done_callback(lambda _: self._admission.release(buffer))
                actual = await asyncio.shield(job)
            else:
                try:
                    actual = self._land(record, spec, view)
                finally:
                    self._admission.release(buffer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("landing piece %d of %r failed", spec.index, record.request_id)
            return self._fail(record, HandoffError(f"landing piece {spec.index} failed: {exc}"))
        self.num_staged += 1
        return self._verify(record, spec, actual)

    def _verify(self, record: InboundTransfer, spec: PieceSpec, actual: int | None) -> None:
        """Count a landed piece whose bytes hash as announced; fail the transfer otherwise."""
        if actual is None or record.terminal:
            self.num_drained += 1
        elif actual != record.piece_digest(spec.index):
            self._fail(record, record.digest_error(spec, actual))
        else:
            record.mark_landed(spec.index)
            self._landed(record)

    def _land(self, record: InboundTransfer, spec: PieceSpec, view: torch.Tensor) -> int | None:
        """Scatter under the write lock, unless the transfer already ended (loop or payload
        thread: see the class docstring)."""
        with record.write_lock:
            if record.terminal:
                return None
            staged = piece_view(view, spec, record.layout)
            return digest_and_scatter(staged, self._cache, record.block_ids, spec, record.layout)
