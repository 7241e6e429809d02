"""The host tier's bytes: a block-major host tensor (pinned on CUDA) and the copy thread that
moves blocks between it and the device cache, off the engine's thread.

Every host block is one contiguous run (all layers, K and V): digests and copies read it whole.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
import xxhash

from pdserve.engine.kv.events import KVEventLog
from pdserve.engine.kv.host_block_pool import HostBlockPool
from pdserve.engine.kv.layout import KVLayout
from pdserve.engine.tiers.job_thread import JobThread

logger = logging.getLogger(__name__)


class CopyKind(StrEnum):
    STORE = "store"  # device -> host
    LOAD = "load"  # host -> device


@dataclass(frozen=True)
class CopyJob:
    job_id: int
    kind: CopyKind
    device_ids: tuple[int, ...]
    host_ids: tuple[int, ...]
    expected_digests: tuple[int, ...] = ()  # LOAD: the host blocks' digests as stored
    request_id: str | None = None


@dataclass(frozen=True)
class CopyDone:
    """A finished copy. STORE: one digest per host block; LOAD: the bytes verified. ``error``
    set: nothing about the destination may be trusted."""

    job: CopyJob
    digests: tuple[int, ...]
    error: str | None
    seconds: float
    num_bytes: int


def block_digest(block: torch.Tensor) -> int:
    """xxh3-64 of one contiguous host block's bytes."""
    return xxhash.xxh3_64_intdigest(block.view(torch.uint8).numpy())


class HostKVTier:
    """Owns the host tensor and its copy thread; the engine owns the block pool's decisions.

    Contract: a STORE reads device blocks the caller keeps pinned until its `CopyDone` is
    polled, and writes host blocks the pool marked WRITING; a LOAD reads host blocks the pool
    marked read and writes device blocks the caller owns and leaves unscheduled until then.
    `poll` runs on the engine thread; ``notify`` is called (copy thread) after each job.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device_cache: torch.Tensor,
                 events: KVEventLog | None = None,
                 notify: Callable[[], None] | None = None) -> None:
        self.layout = layout
        self.pool = HostBlockPool(num_blocks, events)
        self.device_cache = device_cache
        block_shape = (layout.num_local_layers, 2, *layout.block_dims)  # this rank's heads
        pin = device_cache.device.type == "cuda"
        self.host = torch.zeros((num_blocks, *block_shape), dtype=layout.torch_dtype,
                                pin_memory=pin)
        self.block_bytes = layout.num_local_layers * layout.block_bytes
        self._stream = torch.cuda.Stream(device_cache.device) if pin else None
        self._ids = itertools.count(1)
        self.num_in_flight = 0  # engine thread only
        self._worker = JobThread("pdserve-kvcopy", self._copy, notify)
        self.finished = self._worker.finished

    def submit(self, kind: CopyKind, device_ids: Sequence[int], host_ids: Sequence[int],
               request_id: str | None = None) -> CopyJob:
        """Queue a copy (engine thread). LOAD jobs carry the pool's digests to verify."""
        digests = tuple(self.pool.digest(h) for h in host_ids) if kind is CopyKind.LOAD else ()
        job = CopyJob(next(self._ids), kind, tuple(device_ids), tuple(host_ids), digests,
                      request_id)
        self.num_in_flight += 1
        self._worker.submit(job)
        return job

    def poll(self) -> list[CopyDone]:
        """Copies finished since the last poll (engine thread)."""
        done = self._worker.poll()
        self.num_in_flight -= len(done)
        return done

    @property
    def has_finished(self) -> bool:
        return self._worker.has_finished

    def close(self) -> None:
        self._worker.close()

    def _copy(self, job: CopyJob) -> CopyDone:
        start = time.monotonic()
        try:
            digests = self._store(job) if job.kind is CopyKind.STORE else self._load(job)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported with the job, never lost
            logger.warning("KV %s copy failed: %s", job.kind.value, exc)
            digests, error = (), str(exc) or type(exc).__name__
        return CopyDone(job, digests, error, time.monotonic() - start,
                        len(job.host_ids) * self.block_bytes)

    def _store(self, job: CopyJob) -> tuple[int, ...]:
        device = torch.tensor(job.device_ids, dtype=torch.int64, device=self.device_cache.device)
        host = torch.tensor(job.host_ids, dtype=torch.int64)
        with self._on_stream():
            blocks = self.device_cache.index_select(2, device).permute(2, 0, 1, 3, 4, 5)
            self.host.index_copy_(0, host, blocks.to("cpu", non_blocking=False))
        return tuple(block_digest(self.host[h]) for h in job.host_ids)

    def _load(self, job: CopyJob) -> tuple[int, ...]:
        for host_id, expected in zip(job.host_ids, job.expected_digests, strict=True):
            if block_digest(self.host[host_id]) != expected:
                raise ValueError(f"host block {host_id} failed its digest")
        device = torch.tensor(job.device_ids, dtype=torch.int64, device=self.device_cache.device)
        host = torch.tensor(job.host_ids, dtype=torch.int64)
        with self._on_stream():
            blocks = self.host.index_select(0, host).to(self.device_cache.device,
                                                         non_blocking=True)
            self.device_cache.index_copy_(2, device, blocks.permute(1, 2, 0, 3, 4, 5))
        return ()

    def _on_stream(self) -> _StreamScope:
        return _StreamScope(self._stream)


class _StreamScope:
    """Runs a copy on the tier's CUDA stream after the engine's work so far, and waits for
    it; on CPU a plain block."""

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self._stream = stream
        self._ctx: torch.cuda.StreamContext | None = None

    def __enter__(self) -> None:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
            self._ctx = torch.cuda.stream(self._stream)
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._stream is not None and self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._stream.synchronize()
