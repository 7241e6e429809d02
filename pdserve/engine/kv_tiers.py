"""The engine's KV beyond its device blocks: the host tier, the cost model that chooses load
or recompute, the event log the cluster's prefix index follows, and their copies' endings.

`KVTiers.service` runs on the engine thread between steps: it settles finished copies and
starts the stores that releases queued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.host_kv_tier import CopyKind, HostKVTier
from pdserve.engine.kv_cache import GIB, kv_cache_bytes
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_cost import KVCostModel
from pdserve.engine.kv_events import KVEventLog, Tier
from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tier_loads import TierLoads


@dataclass(frozen=True)
class TierStats:
    """Cumulative counters of the tiers beside the device (what /metrics shows per worker)."""

    num_host_blocks: int = 0
    num_host_cached_blocks: int = 0
    num_host_busy_blocks: int = 0
    num_store_pinned_blocks: int = 0
    num_loading: int = 0
    num_host_stores: int = 0
    num_host_store_bytes: int = 0
    num_host_loads: int = 0
    num_host_load_bytes: int = 0
    host_load_seconds: float = 0.0
    num_load_failures: int = 0


def num_host_blocks_for(layout: KVLayout, host_kv_cache_gb: float) -> int:
    return int(host_kv_cache_gb * GIB) // kv_cache_bytes(layout, 1)


class KVTiers:
    """Owns the event log, the cost model and (when sized) the host tier of one engine."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, host_kv_cache_gb: float,
                 enable_prefix_caching: bool) -> None:
        self.layout = layout
        self.events = KVEventLog()
        self.cost = KVCostModel()
        self.wakeup: Callable[[], None] | None = None  # the engine loop's, once it runs
        num_host = num_host_blocks_for(layout, host_kv_cache_gb)
        self.host: HostKVTier | None = None
        if enable_prefix_caching and num_host > 0:
            self.host = HostKVTier(layout, num_host, kv_cache, self.events, self._notify)
        self._counts = {"stores": 0, "store_bytes": 0, "loads": 0, "load_bytes": 0,
                        "failures": 0}
        self._load_seconds = 0.0

    def attach(self, kv: KVCacheManager, scheduler: Scheduler) -> None:
        """Give the scheduler its loads (only with a host tier)."""
        self._kv, self._scheduler = kv, scheduler
        if self.host is not None:
            host = self.host
            scheduler.loads = TierLoads(
                kv, self.cost, host.block_bytes,
                lambda rid, device_ids, host_ids: host.submit(CopyKind.LOAD, device_ids,
                                                              host_ids, rid))

    @property
    def has_work(self) -> bool:
        """Copies that ended and wait to be settled, or stores waiting to start."""
        return self.host is not None and (self.host.has_finished
                                          or self._kv.has_pending_stores)

    def service(self) -> None:
        """Engine thread: settle finished copies, then start the queued stores as one copy."""
        if self.host is None:
            return
        for done in self.host.poll():
            job = done.job
            if job.kind is CopyKind.STORE:
                for i, (device_id, host_id) in enumerate(zip(job.device_ids, job.host_ids,
                                                             strict=True)):
                    digest = done.digests[i] if done.error is None else None
                    self._kv.finish_store(device_id, host_id, digest)
                if done.error is None:
                    self._counts["stores"] += len(job.host_ids)
                    self._counts["store_bytes"] += done.num_bytes
                    self.cost.observe_transfer(Tier.HOST.value, done.num_bytes, done.seconds)
            else:
                assert job.request_id is not None
                if done.error is None:
                    self._counts["loads"] += 1
                    self._counts["load_bytes"] += done.num_bytes
                    self._load_seconds += done.seconds
                else:
                    self._counts["failures"] += 1
                self._scheduler.finish_load(job.request_id, done.error, done.seconds)
        pending = self._kv.take_pending_stores()
        if pending:
            self.host.submit(CopyKind.STORE, [d for d, _ in pending], [h for _, h in pending])

    def stats(self) -> TierStats:
        if self.host is None:
            return TierStats()
        pool, loads = self.host.pool, self._scheduler.loads
        return TierStats(
            num_host_blocks=pool.num_blocks, num_host_cached_blocks=pool.num_cached_blocks,
            num_host_busy_blocks=pool.num_busy_blocks,
            num_store_pinned_blocks=self._kv.num_pinned_by_stores,
            num_loading=0 if loads is None else loads.num_loading,
            num_host_stores=self._counts["stores"],
            num_host_store_bytes=self._counts["store_bytes"],
            num_host_loads=self._counts["loads"], num_host_load_bytes=self._counts["load_bytes"],
            host_load_seconds=self._load_seconds, num_load_failures=self._counts["failures"])

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    def _notify(self) -> None:
        if self.wakeup is not None:
            self.wakeup()
