"""Where a prompt should go: the replicas of a role ranked by the prompt's cached prefix on
each (the cluster prefix index, fed by the workers' KV events) and by their load.

The ingress ranks; the role's request router (`replica_routing.RankedRouter`) follows the
ranking the request carries, and Serve probes and backs off within it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.replica import WorkerLoad
from pdserve.router.kv_event_feed import KVEventFeed
from pdserve.router.pairing import PrefixCost, RecentRoutes, rank_by_prefix
from pdserve.router.prefix_index import PrefixMatch

# Prompts hash at most this many blocks for ranking (256k tokens at block size 16).
MAX_PREFIX_BLOCKS = 16_384
# A host-tier token costs about this fraction of computing one (a load is a copy); the
# worker's own cost model makes the real choice.
HOST_WEIGHT = 0.1
# Decode replicas report requests waiting (for their KV too) up to a report period late; the
# prefix holder keeps the prompt unless it has this many more waiting than the least-waiting
# replica (a single in-flight handoff must not send a repeat's whole prompt elsewhere).
DECODE_WAITING_SLACK = 4


@dataclass(frozen=True)
class Placement:
    """A role's replica ids, best first, and each one's cached prefix for the prompt."""

    ranking: tuple[str, ...]
    matches: dict[str, PrefixMatch]
    block_size: int

    def cached_tokens(self, replica_id: str) -> int:
        match = self.matches.get(replica_id)
        return 0 if match is None else match.num_blocks * self.block_size


class PrefixPlacement:
    """The ingress's prefix index and the rankings made from it, one feed per role."""

    def __init__(self, token: str, block_size: int) -> None:
        self.block_size = block_size  # the config's; a replica's own feed names its own
        self.feeds = {"prefill": KVEventFeed(token), "decode": KVEventFeed(token)}
        self.recent = {role: RecentRoutes() for role in self.feeds}

    def sync(self, role: str, loads: Sequence[tuple[str, WorkerLoad]]) -> None:
        """Follow exactly the role's running replicas (from their latest load reports)."""
        self.feeds[role].sync({rid: load.kv_events_address for rid, load in loads})

    def rank(self, role: str, prompt: Sequence[int], loads: Sequence[tuple[str, WorkerLoad]],
             feed_role: str | None = None) -> Placement:
        """Replicas of ``feed_role`` (default ``role``) by estimated prefill work for
        ``prompt``: the tokens each would compute (after its device prefix; when it prefills,
        ``role`` "prefill", host-tier tokens at a fraction), plus what is queued there. A decode
        worker receiving KV reuses only its device prefix."""
        feed_role = feed_role or role
        feed, now = self.feeds[feed_role], time.monotonic()
        hashed = feed.prompt_hashes(prompt, MAX_PREFIX_BLOCKS)
        costs: dict[str, PrefixCost] = {}
        matches: dict[str, PrefixMatch] = {}
        block_size = self.block_size
        least_waiting = min((load.num_waiting for _, load in loads), default=0)
        for replica_id, load in loads:
            layout, hashes, block_size = hashed.get(replica_id, ("", [], block_size))
            match = feed.index.match(hashes, [replica_id], layout).get(replica_id, PrefixMatch())
            recent = self.recent[feed_role].depth(hashes, replica_id, now)
            device = max(match.num_device_blocks, recent)
            cached = max(match.num_blocks, device) if role == "prefill" else device
            matches[replica_id] = PrefixMatch(device, cached)
            queued = load.num_queued_tokens if feed_role == "prefill" else (
                max(0, load.num_waiting - least_waiting - DECODE_WAITING_SLACK) * len(prompt))
            costs[replica_id] = PrefixCost(max(0, len(prompt) - cached * block_size),
                                           (cached - device) * block_size, queued, HOST_WEIGHT)
        ranks = rank_by_prefix([rid for rid, _ in loads], costs,
                               band_tokens=max(block_size, 0.1 * len(prompt)))
        ranking = tuple(rid for rank in ranks for rid in rank)
        if ranking:
            self.recent[feed_role].record(hashed.get(ranking[0], ("", [], 0))[1], ranking[0],
                                          now)
        return Placement(ranking, matches, block_size)

    def peer_prefixes(self, prompt: Sequence[int],
                      replica_ids: Sequence[str]) -> tuple[tuple[str, int], ...]:
        """(replica id, leading prompt blocks in its device or host tier) of the prefill
        replicas that the index says hold any: sources a prefill worker may pull a prefix
        from (a source brings host-tier blocks back to device KV before it sends them)."""
        feed = self.feeds["prefill"]
        hashed = feed.prompt_hashes(prompt, MAX_PREFIX_BLOCKS)
        held = []
        for replica_id in replica_ids:
            layout, hashes, _ = hashed.get(replica_id, ("", [], 0))
            match = feed.index.match(hashes, [replica_id], layout).get(replica_id)
            if match is not None and match.num_blocks > 0:
                held.append((replica_id, match.num_blocks))
        return tuple(held)

    async def close(self) -> None:
        for feed in self.feeds.values():
            await feed.close()
