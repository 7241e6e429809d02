"""Replica ranking policies, without Ray: prefix affinity for prefill, KV headroom for decode."""

from __future__ import annotations

from pdserve.router.pairing import (
    KVHeadroom,
    PrefixOwnerTable,
    prefix_hashes,
    rank_by_affinity,
    rank_by_headroom,
)


def test_prefix_hashes_chain_and_stop_at_full_blocks() -> None:
    a = prefix_hashes(list(range(40)), block_size=16, max_blocks=8)
    b = prefix_hashes(list(range(32)) + [999] * 8, block_size=16, max_blocks=8)
    assert len(a) == 2 and a == b  # the partial third block never counts
    c = prefix_hashes([5] + list(range(1, 40)), block_size=16, max_blocks=8)
    assert c[0] != a[0] and c[1] != a[1]  # a change early on changes every later hash
    capped = prefix_hashes(list(range(100)), 16, max_blocks=3)
    assert capped == prefix_hashes(list(range(48)), 16, 3)


def test_owner_table_prefers_longest_live_prefix_and_forgets() -> None:
    table = PrefixOwnerTable()
    short, long_ = prefix_hashes(list(range(32)), 16, 8), prefix_hashes(list(range(64)), 16, 8)
    table.record(short, "r1")
    table.record(long_, "r2")  # r2 now owns the first two blocks as well as the next two
    assert table.owner(long_, {"r1", "r2"}) == ("r2", 4)
    assert table.owner(long_, {"r1"}) == (None, 0)  # r2 took over the blocks r1 had
    table.forget("r2")
    assert table.owner(long_, {"r1", "r2"}) == (None, 0)
    bounded = PrefixOwnerTable(max_entries=3)
    bounded.record(long_, "r1")
    assert bounded.owner(long_[:1], {"r1"}) == (None, 0)  # evicted oldest entry first
    assert bounded.owner(long_, {"r1"}) == ("r1", 4)


def test_affinity_ranks_owner_first_unless_it_lags() -> None:
    replicas = ["a", "b", "c"]
    assert rank_by_affinity(replicas, "b", {"a": 0, "b": 2, "c": 1}, 4) == [["b"], ["a", "c"]]
    assert rank_by_affinity(replicas, "b", {"a": 0, "b": 9, "c": 1}, 4) == [["a", "c"], ["b"]]
    assert rank_by_affinity(["a", "b"], None, {}, 4) == [["a", "b"]]
    assert rank_by_affinity(["a"], "a", {"a": 50}, 4) == [["a"]]


def test_headroom_ranks_free_kv_first_within_band() -> None:
    headroom = {"full": KVHeadroom(5, 100), "half": KVHeadroom(50, 100),
                "empty": KVHeadroom(100, 100), "nearly": KVHeadroom(95, 100)}
    ranks = rank_by_headroom(["full", "half", "empty", "nearly"], headroom, band=0.1)
    assert ranks[0] == ["empty", "nearly"]
    assert ranks[1] == ["half", "full"]
    assert rank_by_headroom(["new", "full"], headroom)[0] == ["new"]  # no stats yet: assume free
