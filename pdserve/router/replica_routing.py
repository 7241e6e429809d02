"""Ray Serve request routers for the two roles, built on `pairing.py`'s rankings.

They run inside the ingress's deployment handles. Serve does the probing and backoff: a
router only ranks candidates, and Serve picks the shortest queue within the best rank.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from pdserve.replica import WorkerLoad
from pdserve.router.pairing import (
    KVHeadroom,
    PrefixOwnerTable,
    prefix_hashes,
    rank_by_affinity,
    rank_by_headroom,
)

# Why Serve's RequestRouter and not the ingress's own replica tracking: Serve already knows
# the live replicas, probes queue lengths, retries with backoff and handles replicas dying;
# our policies only add what Serve cannot know (prefix ownership, KV headroom).


def _prompt_of(pending: PendingRequest | None) -> list[int]:
    if pending is None or not pending.args:
        return []
    return list(getattr(pending.args[0], "prompt_token_ids", []) or [])


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Send a prompt where its prefix went last, unless that replica lags: for prefill (the
    prefix is computed already) and for decode (its KV need not be sent again)."""

    def initialize_state(self, block_size: int, max_prefix_blocks: int = 64,
                         max_imbalance: int = 4, **_: Any) -> None:
        """``block_size``: engine.block_size (the app passes it), so hashes cover whole blocks."""
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_imbalance = max_imbalance
        self.owners = PrefixOwnerTable()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        hashes = prefix_hashes(_prompt_of(pending_request), self.block_size,
                               self.max_prefix_blocks)
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner, _ = self.owners.owner(hashes, set(by_id))
        queue_lens = {rid: self.replica_queue_len_cache.get(rid) or 0 for rid in by_id}
        ranks = rank_by_affinity(list(by_id), owner, queue_lens, self.max_imbalance)
        return [[by_id[rid] for rid in rank] for rank in ranks if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        hashes = prefix_hashes(_prompt_of(pending_request), self.block_size,
                               self.max_prefix_blocks)
        self.owners.record(hashes, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.owners.forget(replica_id)


class KVHeadroomRouter(FIFOMixin, RequestRouter):
    """Decode: prefer replicas with the most free KV blocks (from their routing stats)."""

    def initialize_state(self, band: float = 0.1, **_: Any) -> None:
        self.band = band

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        headroom = {}
        for replica in candidate_replicas:
            load = WorkerLoad.from_stats(replica.routing_stats or {})
            if load is not None:
                headroom[replica.replica_id] = KVHeadroom(load.num_free_blocks, load.num_blocks)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid] for rid in rank]
                for rank in rank_by_headroom(list(by_id), headroom, self.band) if rank]


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each replica in turn: the baseline the smarter policies are compared against."""

    def initialize_state(self, **_: Any) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self.turn += 1
        start = self.turn % len(ordered)
        # One replica per rank: Serve would pick the shortest queue within a shared rank.
        return [[r] for r in ordered[start:] + ordered[:start]]
