"""The shared tier: blocks put into a distributed KV store (Mooncake Store) that every worker
reads, keyed by the layout fingerprint and the block hash, each with its digest.

Its own thread runs puts and gets; a store that fails is left alone for a while (counted),
and serving goes on without it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.kv.layout import KVLayout
from pdserve.engine.tiers.host import block_digest
from pdserve.engine.tiers.job_thread import JobThread

logger = logging.getLogger(__name__)

DIGEST_BYTES = 8
# How long a store that failed is left alone before it is asked again.
RETRY_AFTER_S = 5.0


class StoreUnavailableError(RuntimeError):
    """The store did not answer (its master is gone, or the connection broke)."""


class BlockStore(Protocol):
    """A shared store's client as the tier uses it (`engine/tiers/mooncake.py`).

    ``staging`` is a flat uint8 tensor registered with the store: `put` sends rows
    ``[0, len(keys))`` under ``keys``, `get` fills them; both return per key whether it
    worked and raise `StoreUnavailableError` when the store does not answer at all. Called
    from one thread at a time."""

    staging: torch.Tensor

    def put(self, keys: Sequence[str], row_bytes: int) -> list[bool]: ...

    def get(self, keys: Sequence[str], row_bytes: int) -> list[bool]: ...

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StoreJob:
    job_id: int
    put: bool  # else a get
    device_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    request_id: str | None = None


@dataclass(frozen=True)
class StoreDone:
    """A finished job: per block whether it went through; ``error`` names why not."""

    job: StoreJob
    ok: tuple[bool, ...]
    error: str | None
    seconds: float
    num_bytes: int


class StoreKVTier:
    """Owns the client and its thread. Contract as the host tier's: a put reads device blocks
    the caller pins until its `StoreDone` is polled; a get writes device blocks the caller
    owns and leaves unscheduled until then, and only rows whose digest verified."""

    def __init__(self, layout: KVLayout, device_cache: torch.Tensor, client: BlockStore,
                 notify: Callable[[], None] | None = None) -> None:
        self.layout, self.device_cache, self.client = layout, device_cache, client
        self.block_bytes = layout.num_local_layers * layout.block_bytes
        self.row_bytes = self.block_bytes + DIGEST_BYTES
        self.max_rows = client.staging.numel() // self.row_bytes
        if self.max_rows < 1:
            raise ValueError(f"store staging of {client.staging.numel()} bytes holds no block "
                             f"of {self.row_bytes}")
        self._prefix = f"pdkv:{layout.fingerprint}:"
        self._block_shape = (layout.num_local_layers, 2, *layout.block_dims)  # this rank's heads
        self._ids = itertools.count(1)
        self._down_until = 0.0
        self.num_unavailable = 0  # calls the store did not answer
        self._worker = JobThread("pdserve-kvstore", self._transfer, notify)
        self.finished = self._worker.finished

    def key(self, block_hash: bytes) -> str:
        return self._prefix + block_hash.hex()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def continuation(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, the store holds (0 while it is down)."""
        if not hashes or not self.available:
            return 0
        try:
            found = self.client.exists([self.key(h) for h in hashes])
        except StoreUnavailableError as exc:
            self._mark_down(exc)
            return 0
        return next((i for i, held in enumerate(found) if not held), len(found))

    def submit(self, put: bool, device_ids: Sequence[int], hashes: Sequence[bytes],
               request_id: str | None = None) -> StoreJob:
        job = StoreJob(next(self._ids), put, tuple(device_ids), tuple(hashes), request_id)
        self._worker.submit(job)
        return job

    def poll(self) -> list[StoreDone]:
        return self._worker.poll()

    @property
    def has_finished(self) -> bool:
        return self._worker.has_finished

    def close(self) -> None:
        self._worker.close()
        self.client.close()

    def _mark_down(self, exc: Exception) -> None:
        self.num_unavailable += 1
        if self.available:
            logger.warning("the KV store did not answer (%s); serving without it for %.0fs",
                           exc, RETRY_AFTER_S)
        self._down_until = time.monotonic() + RETRY_AFTER_S

    def _transfer(self, job: StoreJob) -> StoreDone:
        start = time.monotonic()
        ok: list[bool] = []
        error = None
        try:
            if not self.available:
                raise StoreUnavailableError("the store is down")
            for at in range(0, len(job.hashes), self.max_rows):
                ok += self._chunk(job, at, min(len(job.hashes), at + self.max_rows))
            if not all(ok):
                error = "store_miss" if not job.put else "store_put"
        except StoreUnavailableError as exc:
            self._mark_down(exc)
            error = "store_unavailable"
        except ValueError as exc:  # a digest that did not verify
            error = "digest" if "digest" in str(exc) else "store_get"
        except Exception as exc:  # noqa: BLE001 - the job's blocks must come back to the engine
            logger.warning("KV store %s failed: %s", "put" if job.put else "get", exc)
            error = "store_put" if job.put else "store_get"
        ok += [False] * (len(job.hashes) - len(ok))
        return StoreDone(job, tuple(ok), error, time.monotonic() - start,
                         sum(ok) * self.row_bytes)

    def _rows(self, count: int) -> torch.Tensor:
        flat = self.client.staging[: count * self.row_bytes]
        return flat.view(count, self.row_bytes)

    def _chunk(self, job: StoreJob, start: int, end: int) -> list[bool]:
        keys = [self.key(h) for h in job.hashes[start:end]]
        rows = self._rows(end - start)
        device_ids = job.device_ids[start:end]
        if job.put:
            for row, device_id in zip(rows, device_ids, strict=True):
                block = self.device_cache[:, :, device_id].contiguous().cpu()
                payload = block.view(torch.uint8).view(-1)
                row[: self.block_bytes].copy_(payload)
                row[self.block_bytes:].copy_(_digest_bytes(block_digest(block)))
            return self.client.put(keys, self.row_bytes)
        got = self.client.get(keys, self.row_bytes)
        # Only a contiguous run from the first block counts: stop at the first miss.
        count = next((i for i, ok in enumerate(got) if not ok), len(got))
        for row, device_id in zip(rows[:count], device_ids[:count], strict=True):
            block = row[: self.block_bytes].view(self.layout.torch_dtype).view(self._block_shape)
            if _digest_bytes(block_digest(block)).tolist() != row[self.block_bytes:].tolist():
                raise ValueError(f"store block for device block {device_id} failed its digest")
            self.device_cache[:, :, device_id].copy_(block)
        return [True] * count + [False] * (len(got) - count)


def _digest_bytes(digest: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(digest.to_bytes(DIGEST_BYTES, "little")),
                            dtype=torch.uint8)
