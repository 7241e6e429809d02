"""Unit tests of the block allocator, its free queue and the block hash.

Eviction order, hit re-checks, touch semantics, and that check_integrity catches corruption.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from pdserve.engine.kv.block_hash import hash_block, hash_full_blocks
from pdserve.engine.kv.block_pool import BlockPool, NoFreeBlocksError


def _cached_pool(num_blocks: int, num_cached: int) -> tuple[BlockPool, list[int], list[bytes]]:
    """A pool whose first `num_cached` allocated blocks are cached and still referenced."""
    pool = BlockPool(num_blocks, enable_prefix_caching=True)
    ids = pool.allocate(num_cached)
    hashes = [hash_block(None, [i, i, i, i], "m") for i in range(num_cached)]
    for block_id, block_hash, i in zip(ids, hashes, range(num_cached), strict=True):
        assert pool.cache_block(block_id, block_hash, [i, i, i, i])
    return pool, ids, hashes


def test_allocate_hands_out_distinct_referenced_blocks() -> None:
    pool = BlockPool(8, enable_prefix_caching=True)
    ids = pool.allocate(5)
    assert len(set(ids)) == 5
    assert all(pool.ref_count(b) == 1 for b in ids)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_blocks) == (3, 5, 8)
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV blocks but only 1"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_release_frees_at_zero_and_refuses_double_release() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    [b] = pool.allocate(1)
    pool.touch([b])
    pool.release([b])
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 3
    pool.release([b])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="no references"):
        pool.release([b])
    pool.check_integrity()


def test_cached_blocks_are_evicted_least_recently_released_first() -> None:
    pool, ids, hashes = _cached_pool(4, 4)
    pool.release([ids[2], ids[0], ids[3], ids[1]])  # release order = LRU order
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    assert pool.allocate(2) == [ids[2], ids[0]]
    assert pool.lookup(hashes[2], [2, 2, 2, 2]) is None  # evicted
    assert pool.lookup(hashes[0], [0, 0, 0, 0]) is None
    assert pool.lookup(hashes[3], [3, 3, 3, 3]) == ids[3]  # still cached while free
    assert pool.num_cached_blocks == 2 and pool.num_evictions == 2
    pool.check_integrity()


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool, cached_ids, hashes = _cached_pool(4, 2)
    plain = pool.allocate(2)
    pool.release(cached_ids)
    pool.release(plain)  # released last, but holds nothing worth keeping
    assert sorted(pool.allocate(2)) == sorted(plain)
    assert pool.lookup(hashes[0], [0, 0, 0, 0]) == cached_ids[0]
    assert pool.lookup(hashes[1], [1, 1, 1, 1]) == cached_ids[1]


def test_forged_hash_collision_misses() -> None:
    pool, [b], [h] = _cached_pool(2, 1)
    assert pool.lookup(h, [0, 0, 0, 0]) == b
    assert pool.lookup(h, [0, 0, 0, 1]) is None  # same hash, other tokens
    assert pool.lookup(hash_block(None, [9, 9, 9, 9], "m"), [0, 0, 0, 0]) is None


def test_touch_of_free_cached_block_takes_it_off_the_free_queue() -> None:
    pool, [b], [h] = _cached_pool(3, 1)
    pool.release([b])
    assert pool.num_free_blocks == 3
    pool.touch([b])  # a prefix hit
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 2
    assert b not in pool.allocate(2)  # cannot be handed out while referenced
    assert pool.lookup(h, [0, 0, 0, 0]) == b
    pool.check_integrity()


def test_shared_block_stays_until_last_reference_goes() -> None:
    pool, [b], _ = _cached_pool(2, 1)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.release([b])
    assert pool.num_free_blocks == 1
    pool.release([b])
    assert pool.num_free_blocks == 2


def test_duplicate_hash_keeps_the_first_block_cached() -> None:
    pool, [first], [h] = _cached_pool(3, 1)
    [second] = pool.allocate(1)
    assert pool.cache_block(second, h, [0, 0, 0, 0]) is False
    assert not pool.is_cached(second) and pool.lookup(h, [0, 0, 0, 0]) == first
    assert pool.cache_block(first, h, [0, 0, 0, 0]) is True  # idempotent
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_block(first, b"x" * 32, [0, 0, 0, 0])
    pool.check_integrity()


def test_cache_block_requires_a_reference() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="no request references"):
        pool.cache_block(0, b"h" * 32, [1, 2])


def test_prefix_caching_disabled_never_caches() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    [b] = pool.allocate(1)
    assert pool.cache_block(b, b"h" * 32, [1]) is False
    assert pool.lookup(b"h" * 32, [1]) is None and pool.num_cached_blocks == 0


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: setattr(p._blocks[0], "ref_count", -1), "negative reference count"),
        (lambda p: setattr(p._blocks[3], "ref_count", 1), "in free queue=True"),
        (lambda p: setattr(p._blocks[0], "ref_count", 0), "in free queue=False"),
        (lambda p: setattr(p._blocks[1], "block_hash", b"z" * 32), "does not point back"),
        (lambda p: setattr(p._free, "_len", 1), "free queue"),
        (lambda p: setattr(p._free._head.next, "prev", None), "free queue"),
    ],
)
def test_check_integrity_catches_corruption(
    corrupt: Callable[[BlockPool], None], message: str
) -> None:
    pool, _, _ = _cached_pool(4, 1)
    pool.allocate(1)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_block_hash_chains_parent_tokens_and_salt() -> None:
    a = hash_block(None, [1, 2, 3, 4], "model-a")
    assert a == hash_block(None, [1, 2, 3, 4], "model-a") and len(a) == 32
    assert a != hash_block(None, [1, 2, 3, 4], "model-b")
    assert a != hash_block(None, [1, 2, 3, 5], "model-a")
    assert hash_block(a, [5, 6, 7, 8], "m") != hash_block(None, [5, 6, 7, 8], "m")
    # Encoding is fixed, not Python's hash(): token 2**40 is not truncated into 0.
    assert hash_block(None, [2**40], "m") != hash_block(None, [0], "m")
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4, "m")
    assert hashes == [hash_block(None, tokens[:4], "m"), hash_block(hashes[0], tokens[4:8], "m")]
    assert hash_full_blocks(tokens, 4, "m", known=hashes[:1]) == hashes


def test_state_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import pdserve.engine.scheduler, pdserve.engine.kv.manager\n"
        "import pdserve.engine.kv.block_pool, pdserve.engine.sampling_params\n"
        "assert 'torch' not in sys.modules, 'a torch-free module imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
