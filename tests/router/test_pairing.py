"""Replica ranking policies, without Ray: cached prefix and load for prefill (and decode's
prefix_affinity), KV headroom for decode; the prefix index and placement over it."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.kv.block_hash import hash_full_blocks
from pdserve.engine.kv.events import EventKind, Tier
from pdserve.planes.kv_event_wire import WorkerIdentity
from pdserve.replica import WorkerLoad
from pdserve.router.pairing import (
    KVHeadroom,
    PrefixCost,
    RecentRoutes,
    rank_by_headroom,
    rank_by_prefix,
)
from pdserve.router.placement import PrefixPlacement
from pdserve.router.prefix_index import PrefixIndex, PrefixMatch


def test_recent_routes_follow_a_prompt_for_their_ttl_only() -> None:
    routes = RecentRoutes(ttl_s=5.0)
    routes.record([b"a", b"b", b"c"], "r1", now=0.0)
    assert routes.depth([b"a", b"b", b"x"], "r1", now=1.0) == 2
    assert routes.depth([b"a"], "r2", now=1.0) == 0
    assert routes.depth([b"a", b"b"], "r1", now=6.0) == 0  # expired
    routes.forget("r1")
    assert routes.depth([b"a"], "r1", now=1.0) == 0


def test_prefix_ranking_weighs_compute_host_tokens_and_queues() -> None:
    costs = {"hit": PrefixCost(100, 0, 0, 0.1), "host": PrefixCost(100, 900, 0, 0.1),
             "miss": PrefixCost(1000, 0, 0, 0.1), "busy": PrefixCost(100, 0, 5000, 0.1)}
    ranks = rank_by_prefix(["miss", "busy", "host", "hit", "new"], costs, band_tokens=16)
    assert ranks == [["hit"], ["host"], ["miss"], ["busy"], ["new"]]
    tied = rank_by_prefix(["a", "b"], {"a": PrefixCost(10, 0, 0, 0.1),
                                       "b": PrefixCost(20, 0, 0, 0.1)}, band_tokens=16)
    assert tied == [["a", "b"]]  # within the band: Serve picks the shorter queue


def test_the_index_matches_contiguous_prefixes_per_tier_and_layout() -> None:
    index = PrefixIndex()
    index.reset("r1", "L", 0, {Tier.DEVICE: [b"a", b"b"], Tier.HOST: [b"c"]})
    index.reset("r2", "L", 0, {Tier.DEVICE: [b"a", b"c"]})  # b missing: c is a fragment
    index.reset("other", "M", 0, {Tier.DEVICE: [b"a", b"b", b"c"]})
    found = index.match([b"a", b"b", b"c", b"d"], ["r1", "r2", "other"], "L")
    assert found == {"r1": PrefixMatch(2, 3), "r2": PrefixMatch(1, 1)}
    index.check_integrity()


def test_index_events_apply_in_order_and_a_gap_drops_the_replica() -> None:
    index = PrefixIndex()
    index.reset("r1", "L", 4, {Tier.DEVICE: [b"a"]})
    assert index.apply("r1", 5, [(EventKind.STORED, Tier.DEVICE, b"b"),
                                 (EventKind.REMOVED, Tier.DEVICE, b"a"),
                                 (EventKind.STORED, Tier.HOST, b"a")])
    assert index.seq("r1") == 7
    assert index.match([b"a", b"b"], ["r1"], "L") == {"r1": PrefixMatch(0, 2)}
    assert not index.apply("r1", 9, [(EventKind.STORED, Tier.DEVICE, b"c")])  # 8 is missing
    assert index.replica_ids == [] and index.num_gaps == 1
    assert index.match([b"a"], ["r1"], "L") == {}
    index.check_integrity()


def _placement(role: str, prompt: list[int],
               holds: Callable[[list[bytes]], dict[str, dict[Tier, list[bytes]]]],
               ) -> PrefixPlacement:
    """A placement whose ``role`` feed followed each replica's snapshot: ``holds(chain)``
    names, per replica, the prompt's block hashes (block size 16) it holds in each tier."""
    placement = PrefixPlacement("token-0123456789abcdef", 16)
    feed = placement.feeds[role]
    for rid, tiers in holds(hash_full_blocks(prompt, 16, "salt")).items():
        feed.identities[rid] = WorkerIdentity(rid, "L", "salt", 16)
        feed.index.reset(rid, "L", 0, tiers)
    return placement


def test_placement_ranks_by_the_engines_own_hashes() -> None:
    prompt = list(range(64))
    placement = _placement("prefill", prompt, lambda chain: {
        "warm": {Tier.DEVICE: chain[:3]}, "cold": {Tier.DEVICE: []}})
    load = WorkerLoad(num_blocks=8, num_free_blocks=8, num_running=0, num_waiting=0)
    placed = placement.rank("prefill", prompt, [("cold", load), ("warm", load)])
    assert placed.ranking == ("warm", "cold")
    assert placed.cached_tokens("warm") == 48 and placed.cached_tokens("cold") == 0


def test_a_decode_prefix_holder_keeps_a_repeat_unless_far_busier() -> None:
    prompt = list(range(64))
    placement = _placement("decode", prompt, lambda chain: {
        "holder": {Tier.DEVICE: chain[:3]}, "other": {Tier.DEVICE: []}})

    def load(waiting: int) -> WorkerLoad:
        return WorkerLoad(num_blocks=8, num_free_blocks=8, num_running=0, num_waiting=waiting)

    # One request awaiting its KV (as a late load report shows it) does not move the repeat.
    placed = placement.rank("decode", prompt, [("other", load(0)), ("holder", load(1))])
    assert placed.ranking[0] == "holder"
    placed = placement.rank("decode", prompt, [("other", load(0)), ("holder", load(6))])
    assert placed.ranking[0] == "other"


def test_headroom_ranks_free_kv_first_within_band() -> None:
    headroom = {"full": KVHeadroom(5, 100), "half": KVHeadroom(50, 100),
                "empty": KVHeadroom(100, 100), "nearly": KVHeadroom(95, 100)}
    ranks = rank_by_headroom(["full", "half", "empty", "nearly"], headroom, band=0.1)
    assert ranks[0] == ["empty", "nearly"]
    assert ranks[1] == ["half", "full"]
    assert rank_by_headroom(["new", "full"], headroom)[0] == ["new"]  # no stats yet: assume free


def test_peer_prefixes_name_the_replicas_whose_device_or_host_holds_the_prompt() -> None:
    prompt = list(range(80))
    placement = _placement("prefill", prompt, lambda chain: {
        "long": {Tier.DEVICE: chain[:4]}, "short": {Tier.DEVICE: chain[:1]},
        "host-only": {Tier.HOST: chain[:3]},
        "split": {Tier.DEVICE: chain[:1], Tier.HOST: chain[1:2]},
        "gap": {Tier.HOST: chain[1:4]}, "cold": {}})
    held = placement.peer_prefixes(
        prompt, ["cold", "short", "long", "host-only", "split", "gap", "unknown"])
    # Only a run from the first block counts, across the tiers; a run after a gap is nothing.
    assert held == (("short", 1), ("long", 4), ("host-only", 3), ("split", 2))
