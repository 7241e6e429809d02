"""The engine's KV beyond its device blocks: the host tier, the shared store, other workers'
caches (peer pulls), the cost model that chooses load or recompute, the event log the
cluster's prefix index follows, and the endings of their copies.

`KVTiers.service` runs on the engine thread between steps: it settles finished copies and
starts the stores that releases queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.kv.cache import GIB, kv_cache_bytes
from pdserve.engine.kv.events import KVEventLog, Tier
from pdserve.engine.kv.layout import KVLayout
from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tiers.cost import KVCostModel
from pdserve.engine.tiers.host import CopyKind, HostKVTier
from pdserve.engine.tiers.loads import LoadPlan, TierLoads
from pdserve.engine.tiers.peer import PeerPull, PeerTier
from pdserve.engine.tiers.store import BlockStore, StoreKVTier


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
    num_store_puts: int = 0
    num_store_put_failures: int = 0
    num_store_loads: int = 0
    num_store_load_bytes: int = 0
    num_store_unavailable: int = 0
    num_peer_loads: int = 0
    num_peer_load_bytes: int = 0
    peer_load_seconds: float = 0.0
    num_peer_pinned_blocks: int = 0  # cached blocks a peer's pull reads (deferred free)


def num_host_blocks_for(layout: KVLayout, host_kv_cache_gb: float) -> int:
    return int(host_kv_cache_gb * GIB) // kv_cache_bytes(layout, 1)


class KVTiers:
    """Owns the event log, the cost model and (when sized) the host tier of one engine."""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, host_kv_cache_gb: float,
                 enable_prefix_caching: bool, always_load: bool) -> None:
        """``always_load``: every prefix another tier holds is loaded (engine.kv_load_policy
        always), the cost model still measuring."""
        self.layout = layout
        self.events = KVEventLog()
        self.cost = KVCostModel(always_load)
        # Told of each load once its copy was submitted (the prefill worker's fault point).
        self.on_load: Callable[[], None] | None = None
        self.wakeup: Callable[[], None] | None = None  # the engine loop's, once it runs
        num_host = num_host_blocks_for(layout, host_kv_cache_gb)
        self.host: HostKVTier | None = None
        if enable_prefix_caching and num_host > 0:
            self.host = HostKVTier(layout, num_host, kv_cache, self.events, self._notify)
        self.store: StoreKVTier | None = None
        self.peer: PeerTier | None = None
        self._device_cache = kv_cache
        self._counts = dict.fromkeys(("stores", "store_bytes", "loads", "load_bytes",
                                      "failures", "puts", "put_failures", "store_loads",
                                      "store_load_bytes", "peer_loads", "peer_load_bytes"), 0)
        self._load_seconds = 0.0
        self._peer_seconds = 0.0

    def attach(self, kv: KVCacheManager, scheduler: Scheduler) -> None:
        """Give the scheduler its loads (only with a host tier or a store)."""
        self._kv, self._scheduler = kv, scheduler
        if self.host is not None:
            self._give_loads()

    def attach_store(self, client: BlockStore) -> None:
        """Share blocks through ``client``'s store: released cached blocks are put, and a
        prefix the store holds may load from it (engine thread, before any request)."""
        self.store = StoreKVTier(self.layout, self._device_cache, client, self._notify)
        self._kv.write_back.puts = True
        self._give_loads()

    def attach_peer(self, pull: PeerPull, latency_s: float, bytes_per_s: float) -> None:
        """Pull prefixes that another worker caches through ``pull`` (engine thread, before
        any request); a pull is assumed to cost ``latency_s`` plus bytes / ``bytes_per_s``
        until one is measured."""
        self.peer = PeerTier(pull, self._notify)
        self.cost.set_prior(Tier.PEER.value, latency_s, bytes_per_s)
        self._give_loads()

    def _give_loads(self) -> None:
        sizes = {Tier.HOST: self.host.block_bytes if self.host else 0,
                 Tier.STORE: self.store.row_bytes if self.store else 0,
                 Tier.PEER: kv_cache_bytes(self.layout, 1)}
        store, peer = self.store, self.peer
        self._scheduler.loads = TierLoads(
            self._kv, self.cost, sizes, self._submit_load,
            None if store is None else lambda hashes: store.continuation(hashes),
            None if peer is None else peer.blocks_held)

    def _submit_load(self, request_id: str, plan: LoadPlan, device_ids: list[int]) -> None:
        if plan.tier is Tier.PEER:
            assert self.peer is not None
            request = self._scheduler.get_request(request_id)
            assert request is not None
            end = (plan.first_block + plan.num_blocks) * self._kv.block_size
            self.peer.pull(request_id, request.token_ids_slice(0, end), plan.first_block,
                           device_ids)
        elif plan.tier is Tier.HOST:
            assert self.host is not None
            self.host.submit(CopyKind.LOAD, device_ids, plan.host_ids, request_id)
        else:
            assert self.store is not None
            self.store.submit(False, device_ids, plan.hashes, request_id)
        if self.on_load is not None and plan.tier is not Tier.PEER:
            self.on_load()

    @property
    def has_work(self) -> bool:
        """Copies that ended and wait to be settled, or copies waiting to start."""
        host_done = self.host is not None and self.host.has_finished
        store_done = self.store is not None and self.store.has_finished
        if self.peer is not None and self.peer.has_finished:
            return True
        return host_done or store_done or (
            (self.host is not None or self.store is not None) and self._kv.write_back.has_pending)

    def service(self) -> None:
        """Engine thread: settle finished copies, then start the queued write-backs."""
        if self.host is not None:
            self._service_host(self.host)
        if self.store is not None:
            self._service_store(self.store)
        if self.peer is not None:
            for done in self.peer.poll():
                if done.error is None:
                    self._counts["peer_loads"] += 1
                    self._counts["peer_load_bytes"] += done.num_bytes
                    self._peer_seconds += done.seconds
                else:
                    self._counts["failures"] += 1
                self._scheduler.finish_load(done.request_id, done.error, done.seconds)

    def _service_store(self, store: StoreKVTier) -> None:
        for done in store.poll():
            job = done.job
            if job.put:
                for device_id, ok in zip(job.device_ids, done.ok, strict=True):
                    self._kv.write_back.finish_put(device_id, ok)
                self._counts["puts"] += sum(done.ok)
                self._counts["put_failures"] += len(done.ok) - sum(done.ok)
                if done.error is None:
                    self.cost.observe_transfer(Tier.STORE.value, done.num_bytes, done.seconds)
                continue
            assert job.request_id is not None
            error = done.error if done.error is not None or all(done.ok) else "store_miss"
            if error is None:
                self._counts["store_loads"] += 1
                self._counts["store_load_bytes"] += done.num_bytes
            else:
                self._counts["failures"] += 1
            self._scheduler.finish_load(job.request_id, error, done.seconds)
        puts = self._kv.write_back.take_puts()
        if puts:
            store.submit(True, [d for d, _ in puts], [h for _, h in puts])

    def _service_host(self, host: HostKVTier) -> None:
        for done in host.poll():
            job = done.job
            if job.kind is CopyKind.STORE:
                for i, (device_id, host_id) in enumerate(zip(job.device_ids, job.host_ids,
                                                             strict=True)):
                    digest = done.digests[i] if done.error is None else None
                    self._kv.write_back.finish_host_store(device_id, host_id, digest)
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
        pending = self._kv.write_back.take_host_stores()
        if pending:
            host.submit(CopyKind.STORE, [d for d, _ in pending], [h for _, h in pending])

    def wait_finished(self, timeout_s: float = 1.0) -> None:
        """Block (offline callers only) until a copy ends: every request is loading."""
        events = [t.finished for t in (self.host, self.store) if t is not None]
        deadline = time.monotonic() + timeout_s
        while events and not any(e.is_set() for e in events) and time.monotonic() < deadline:
            events[0].wait(0.01)

    def stats(self) -> TierStats:
        pool, loads, c = (self.host.pool if self.host else None), self._scheduler.loads, \
            self._counts
        return TierStats(
            num_host_blocks=pool.num_blocks if pool else 0,
            num_host_cached_blocks=pool.num_cached_blocks if pool else 0,
            num_host_busy_blocks=pool.num_busy_blocks if pool else 0,
            num_store_pinned_blocks=self._kv.write_back.num_pinned,
            num_loading=0 if loads is None else loads.num_loading,
            num_host_stores=c["stores"], num_host_store_bytes=c["store_bytes"],
            num_host_loads=c["loads"], num_host_load_bytes=c["load_bytes"],
            host_load_seconds=self._load_seconds, num_load_failures=c["failures"],
            num_store_puts=c["puts"], num_store_put_failures=c["put_failures"],
            num_store_loads=c["store_loads"], num_store_load_bytes=c["store_load_bytes"],
            num_store_unavailable=self.store.num_unavailable if self.store else 0,
            num_peer_loads=c["peer_loads"], num_peer_load_bytes=c["peer_load_bytes"],
            peer_load_seconds=self._peer_seconds,
            num_peer_pinned_blocks=self._kv.num_pinned_for_peers)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        if self.store is not None:
            self.store.close()

    def _notify(self) -> None:
        if self.wakeup is not None:
            self.wakeup()
