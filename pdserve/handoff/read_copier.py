"""Pieces a same-host receiver reads from its sender's exported cache: the records of a read
slot checked like frames, then a small pool of threads (``HandoffConfig.read_threads``) that
copies and hashes pieces side by side, checks each against its announced digest and ends the
transfer from the copying thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.errors import HandoffError, HandoffPeerGoneError, HandoffProtocolError
from pdserve.handoff.faults import ReceiverFaults
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.kvcopy import cache_rows, read_piece
from pdserve.handoff.piece_plan import PieceSpec
from pdserve.handoff.read_slots import KIND_FENCE, KIND_PIECE

log = logging.getLogger(__name__)
EndFn = Callable[[InboundTransfer, "HandoffError | None"], object]
RecordFn = Callable[[InboundTransfer], None]


class ReadCopier:
    """Runs each piece's copy on the pool, under the rules direct writes follow: a copy starts
    only while its transfer is live (`InboundTransfer.begin_direct_write`), and a transfer that
    ended meanwhile is settled by its last copy. Outcomes: ``end(record, error)`` (any thread)
    for a failed piece, ``end(record, None)`` once the fence verified and every piece landed."""

    def __init__(self, cache: torch.Tensor, threads: int, faults: ReceiverFaults,
                 end: EndFn, settle: RecordFn) -> None:
        self._cache, self._faults, self._end, self._settle = cache, faults, end, settle
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "pdserve-handoff-read")
        self._rows: dict[KVLayout, np.ndarray] = {}  # the cache's byte rows, per layout
        self._count_lock = threading.Lock()
        self.num_read = 0  # pieces copied and verified
        self.num_dropped = 0  # pieces whose transfer ended before their copy started
        self.num_pending = 0  # pieces submitted whose copy has not finished

    def submit(self, record: InboundTransfer, spec: PieceSpec) -> None:
        self._count(pending=1)
        try:
            self._pool.submit(self._copy, record, spec)
        except RuntimeError:  # shutting down: the transfer is being cancelled anyway
            self._count(dropped=1, pending=-1)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def on_slot_record(self, record: InboundTransfer, kind: int, body: dict[str, Any]) -> bool:
        """Watcher thread: a record of ``record``'s read slot, checked as its frame would be;
        a piece is queued for copying. Returns whether more records follow (not after the
        fence or a failure)."""
        complete = False
        try:
            with record.write_lock:
                if record.terminal or record.session_id is None:
                    return False
                if kind == KIND_PIECE:
                    spec = record.accept_piece(record.session_id, body, True, slotted=True)
                elif kind == KIND_FENCE:
                    record.accept_fence(record.session_id, body, slotted=True)
                    complete = record.completion() is not None
                else:
                    raise HandoffProtocolError(f"read slot record of unknown kind {kind}")
        except HandoffError as exc:
            self._end(record, exc)
            return False
        if kind == KIND_PIECE:
            self.submit(record, spec)
            return True
        if complete:
            self._end(record, None)
        return False

    def _copy(self, record: InboundTransfer, spec: PieceSpec) -> None:
        if self._faults.recv_delay_s:
            time.sleep(self._faults.recv_delay_s)
        with record.write_lock:
            source = record.source
            started = source is not None and record.begin_direct_write()
        if not started or source is None:
            return self._count(dropped=1, pending=-1)
        error: HandoffError | None = None
        actual = 0
        try:
            actual = self._read(record, spec)
        except HandoffError as exc:
            error = exc
        except Exception as exc:
            log.exception("reading piece %d of %r failed", spec.index, record.request_id)
            error = HandoffError(f"reading KV from the sender failed: {exc}")
        complete = False
        with record.write_lock:
            if error is None and not record.terminal:
                if actual == record.piece_digest(spec.index):
                    record.mark_landed(spec.index)
                    complete = record.completion() is not None
                else:
                    error = record.digest_error(spec, actual)
            last = record.end_direct_write()
        self._count(read=int(error is None), pending=-1)
        if error is not None:
            self._end(record, error)
        elif complete:
            self._end(record, None)
        if last:
            self._settle(record)
        return None

    def _read(self, record: InboundTransfer, spec: PieceSpec) -> int:
        source = record.source
        assert source is not None
        if not source.memory.pin():
            raise HandoffPeerGoneError("the sender's KV cache was unmapped (session ended)")
        try:
            return read_piece(source.rows, source.ids, self._rows_for(record), source.dst_ids,
                              spec, source.runs,
                              corrupt=self._faults.corrupt_read_piece == spec.index)
        finally:
            source.memory.unpin()

    def _rows_for(self, record: InboundTransfer) -> np.ndarray:
        rows = self._rows.get(record.layout)
        if rows is None:  # two threads may both build it: the same view either way
            rows = self._rows[record.layout] = cache_rows(self._cache, record.layout)
        return rows

    def _count(self, read: int = 0, dropped: int = 0, pending: int = 0) -> None:
        with self._count_lock:
            self.num_read += read
            self.num_dropped += dropped
            self.num_pending += pending
