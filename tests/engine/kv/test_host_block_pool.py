"""The host tier's state without torch: stores, reads, LRU eviction, events, integrity, and
the device manager's write-back pins."""

from __future__ import annotations

import pytest

from pdserve.engine.kv.events import EventKind, KVEventLog, Tier
from pdserve.engine.kv.host_block_pool import HostBlockPool
from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiers.cost import KVCostModel, TransferRate


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def ready(pool: HostBlockPool, i: int) -> int:
    host_id = pool.begin_store(h(i), [i])
    assert host_id is not None
    pool.finish_store(host_id, digest=1000 + i)
    return host_id


def test_a_store_is_found_only_once_ready_and_only_with_its_tokens() -> None:
    pool = HostBlockPool(2)
    host_id = pool.begin_store(h(1), [1])
    assert host_id is not None and pool.lookup(h(1), [1]) is None and pool.holds(h(1))
    assert pool.begin_store(h(1), [1]) is None  # one copy of a hash at a time
    pool.finish_store(host_id, digest=7)
    assert pool.lookup(h(1), [1]) == host_id and pool.lookup(h(1), [2]) is None
    assert pool.digest(host_id) == 7
    pool.check_integrity()


def test_eviction_takes_the_least_recently_used_unread_block_never_a_read_one() -> None:
    pool = HostBlockPool(2)
    a, b = ready(pool, 1), ready(pool, 2)
    pool.begin_read([a])
    c = pool.begin_store(h(3), [3])
    assert c == b and pool.lookup(h(2), [2]) is None  # b evicted, a is being read
    assert pool.begin_store(h(4), [4]) is None  # a read, c written: nothing to evict
    pool.end_read([a])
    pool.finish_store(c, digest=3)
    assert pool.begin_store(h(5), [5]) == a  # a is the LRU now
    pool.check_integrity()
    assert pool.num_busy_blocks == 1


def test_a_failed_store_frees_its_block_and_a_dropped_block_is_gone() -> None:
    pool = HostBlockPool(1)
    host_id = pool.begin_store(h(1), [1])
    assert host_id is not None
    pool.finish_store(host_id, digest=None)
    assert not pool.holds(h(1)) and pool.num_busy_blocks == 0
    again = ready(pool, 1)
    pool.drop(again)
    assert pool.lookup(h(1), [1]) is None
    pool.check_integrity()


def test_events_follow_ready_and_evicted_blocks_with_sequence_numbers() -> None:
    log = KVEventLog()
    seen = []
    snapshot = log.snapshot_and_subscribe(seen.append)
    assert snapshot.seq == 0
    pool = HostBlockPool(1, log)
    ready(pool, 1)
    ready(pool, 2)  # evicts 1
    assert [(e.seq, e.kind, e.tier, e.block_hash) for e in seen] == [
        (1, EventKind.STORED, Tier.HOST, h(1)), (2, EventKind.REMOVED, Tier.HOST, h(1)),
        (3, EventKind.STORED, Tier.HOST, h(2))]
    later = log.snapshot_and_subscribe(lambda e: None)
    assert later.seq == 3 and later.blocks[Tier.HOST] == [h(2)]


def test_integrity_catches_a_ready_block_outside_the_lru() -> None:
    pool = HostBlockPool(2)
    host_id = ready(pool, 1)
    pool._lru.pop(host_id)  # a reader-less ready block must be evictable
    with pytest.raises(AssertionError, match="in LRU"):
        pool.check_integrity()


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(), (0,))


def test_released_cached_blocks_are_pinned_until_their_host_copy_ends() -> None:
    log = KVEventLog()
    host = HostBlockPool(8, log)
    kv = KVCacheManager(4, 4, "m", True, events=log, host_pool=host)
    a = _request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    kv.free(a)
    pending = kv.write_back.take_host_stores()
    assert len(pending) == 3 and kv.write_back.take_host_stores() == []
    assert kv.num_free_blocks == 1  # three pinned by their stores
    kv.check_integrity()
    b = _request("b", list(range(100, 116)))
    assert kv.allocate_slots(b, 16) is None  # pinned blocks are never evicted mid-copy
    for device_id, host_id in pending:
        kv.write_back.finish_host_store(device_id, host_id, digest=host_id)
    assert kv.num_free_blocks == 4 and host.num_cached_blocks == 3
    assert kv.find_host_continuation(_request("c", list(range(13))), 0) == [h for _, h in pending]
    assert log.count(Tier.DEVICE) == 3 and log.count(Tier.HOST) == 3
    kv.check_integrity()


def test_the_cost_model_fits_latency_and_bandwidth_and_picks_the_cheaper() -> None:
    rate = TransferRate()
    for num_bytes in (1000, 2000, 4000):
        rate.observe(num_bytes, 0.01 + num_bytes / 1e6)
    latency, bandwidth = rate.fit() or (0, 0)
    assert latency == pytest.approx(0.01) and bandwidth == pytest.approx(1e6)
    model = KVCostModel(False)
    assert model.decide("host", 16, 1000, 16).load  # nothing measured: try (and measure)
    model.observe_transfer("host", 1000, 0.011)
    model.observe_transfer("host", 2000, 0.012)
    model.observe_prefill(1000, 1000, 1.0)  # 1000 tokens/s
    cheap = model.decide("host", 512, 100_000, 1024)
    assert cheap.load and cheap.load_s == pytest.approx(0.11) and cheap.compute_s == 0.512
    slow = model.decide("host", 4, 100_000, 1024)
    assert not slow.load  # 4 tokens compute in 4 ms; the copy takes 110 ms
