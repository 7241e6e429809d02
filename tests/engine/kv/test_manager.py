"""Unit tests of the KV cache manager: block tables, prefix lookups, caching and freeing.

Requests are driven by hand here; the scheduler tests cover the same paths end to end.
"""

from __future__ import annotations

from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(), (0,))


def _compute_prompt(kv: KVCacheManager, request: Request) -> None:
    """Own blocks for the whole prompt and mark it computed and cached (as a prefill would)."""
    cached, num_cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_prompt_tokens - num_cached, cached) is not None
    request.num_computed_tokens = request.num_prompt_tokens
    kv.cache_full_blocks(request)


def test_allocate_slots_grows_the_table_only_at_block_boundaries() -> None:
    kv = KVCacheManager(8, 4, "m", True)
    r = _request("a", list(range(10)))
    assert len(kv.allocate_slots(r, 10) or []) == 3
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == []  # positions 10, 11 fit in block 2
    r.num_computed_tokens = 12
    assert len(kv.allocate_slots(r, 1) or []) == 1
    assert len(kv.block_ids("a")) == 4 and kv.num_free_blocks == 4
    kv.check_integrity()


def test_allocate_slots_returns_none_and_changes_nothing_when_full() -> None:
    kv = KVCacheManager(4, 4, "m", True)
    a = _request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    b = _request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    kv.check_integrity()


def test_prefix_hit_shares_blocks_and_never_covers_the_last_token() -> None:
    kv = KVCacheManager(16, 4, "m", True)
    a = _request("a", list(range(12)))
    _compute_prompt(kv, a)
    same = _request("same", list(range(12)))  # identical prompt, 3 full blocks
    cached, num_cached = kv.find_cached_prefix(same)
    assert cached == kv.block_ids("a")[:2] and num_cached == 8  # last block recomputed
    longer = _request("longer", list(range(13)))
    cached, num_cached = kv.find_cached_prefix(longer)
    assert cached == kv.block_ids("a") and num_cached == 12
    assert kv.allocate_slots(longer, 1, cached) == [kv.block_ids("longer")[3]]
    assert kv.block_ids("longer")[:3] == kv.block_ids("a")
    kv.check_integrity()  # ref counts == 2 for the shared blocks (holders counted)
    kv.free(a)
    assert kv.num_free_blocks == 12  # the shared blocks are still held by "longer"
    kv.free(longer)
    assert kv.num_free_blocks == 16 and kv.num_cached_blocks == 3
    kv.check_integrity()


def test_divergent_prompt_hits_only_the_common_prefix() -> None:
    kv = KVCacheManager(16, 4, "m", True)
    _compute_prompt(kv, _request("a", list(range(12))))
    b = _request("b", list(range(6)) + [99] * 6)
    cached, num_cached = kv.find_cached_prefix(b)
    assert num_cached == 4 and cached == kv.block_ids("a")[:1]


def test_other_salt_never_hits() -> None:
    kv = KVCacheManager(8, 4, "model-a", True)
    _compute_prompt(kv, _request("a", list(range(9))))
    assert kv.find_cached_prefix(_request("c", list(range(9))))[1] == 8
    kv.salt = "model-b"  # the same cache contents, looked up as another model
    assert kv.find_cached_prefix(_request("b", list(range(9)))) == ([], 0)


def test_free_releases_tail_blocks_first_so_they_are_evicted_first() -> None:
    kv = KVCacheManager(4, 4, "m", True)
    a = _request("a", list(range(16)))
    _compute_prompt(kv, a)  # 4 full cached blocks
    a_blocks = kv.block_ids("a")
    kv.free(a)
    assert kv.allocate_slots(_request("filler", [500]), 1) == [a_blocks[3]]
    again = _request("again", list(range(16)) + [7])
    assert kv.find_cached_prefix(again) == (a_blocks[:3], 12)  # only the last block was lost


def test_hit_on_free_cached_blocks_is_not_evicted_by_its_own_allocation() -> None:
    kv = KVCacheManager(4, 4, "m", True)
    x = _request("x", list(range(8)))
    _compute_prompt(kv, x)
    y = _request("y", list(range(100, 108)))
    _compute_prompt(kv, y)
    kv.free(x)  # x's blocks are now first in line for eviction
    kv.free(y)
    x_blocks = set(kv.find_cached_prefix(_request("probe", list(range(9))))[0])
    z = _request("z", list(range(8)) + [50] * 8)
    cached, num_cached = kv.find_cached_prefix(z)
    assert set(cached) == x_blocks and num_cached == 8
    new = kv.allocate_slots(z, 8, cached)
    assert new is not None and not set(new) & x_blocks
    assert kv.block_ids("z")[:2] == cached
    kv.check_integrity()


def test_hits_plus_new_blocks_that_do_not_fit_touch_nothing() -> None:
    kv = KVCacheManager(4, 4, "m", True)
    _compute_prompt(kv, a := _request("a", list(range(8))))
    kv.free(a)
    big = _request("big", list(range(8)) + [9] * 12)  # 2 hits + 3 new > 4 blocks
    cached, _ = kv.find_cached_prefix(big)
    assert len(cached) == 2
    assert kv.allocate_slots(big, 12, cached) is None
    assert kv.num_free_blocks == 4 and kv.block_ids("big") == []
    kv.check_integrity()


def test_cache_full_blocks_registers_only_computed_full_blocks() -> None:
    kv = KVCacheManager(8, 4, "m", True)
    a = _request("a", list(range(10)))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 1
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 2  # the third block holds only 2 tokens
    a.output_token_ids.extend([1, 2])
    a.num_computed_tokens = 12  # decode filled block 2 with an output token
    kv.allocate_slots(a, 0)
    kv.cache_full_blocks(a)
    assert kv.num_cached_blocks == 3
    probe = _request("p", list(range(10)) + [1, 2, 3])
    assert kv.find_cached_prefix(probe)[1] == 12  # outputs are part of the cached prefix


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(8, 4, "m", False)
    _compute_prompt(kv, _request("a", list(range(9))))
    assert kv.find_cached_prefix(_request("b", list(range(9)))) == ([], 0)
    assert kv.num_cached_blocks == 0
