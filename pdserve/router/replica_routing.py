"""Ray Serve request routers for the two roles, built on `pairing.py`'s rankings.

They run inside the ingress's deployment handles. Serve does the probing and backoff: a
router only ranks candidates, and Serve picks the shortest queue within the best rank.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from pdserve.replica import WorkerLoad
from pdserve.router.pairing import KVHeadroom, rank_by_headroom

# Why Serve's RequestRouter and not the ingress's own replica tracking: Serve already knows
# the live replicas, probes queue lengths, retries with backoff and handles replicas dying;
# our policies only add what Serve cannot know (cached prefixes, KV headroom).


def _pinned(candidates: list[RunningReplica],
            pending: PendingRequest | None) -> list[list[RunningReplica]] | None:
    """The one replica a call names as ``pinned_replica`` (a prefix pull asks the worker
    that caches it), while it runs; None otherwise (the policy chooses)."""
    if pending is None or not pending.args:
        return None
    pinned = getattr(pending.args[0], "pinned_replica", None)
    chosen = [r for r in candidates if str(r.replica_id.unique_id) == pinned]
    return [chosen] if pinned and chosen else None


def _ranking_of(pending: PendingRequest | None) -> tuple[str, ...]:
    if pending is None or not pending.args:
        return ()
    return tuple(getattr(pending.args[0], "replica_ranking", ()) or ())


class _PolicyRouter(FIFOMixin, RequestRouter):
    """A call that names a ``pinned_replica`` goes there; the others by the policy's `rank`."""

    def initialize_state(self, **_: Any) -> None:
        pass

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        return self.rank(candidate_replicas, pending_request) if candidate_replicas else []

    def rank(self, candidate_replicas: list[RunningReplica],
             pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        raise NotImplementedError


class RankedRouter(_PolicyRouter):
    """Follow the replica ranking the ingress put on the request (`router/placement.py`:
    cached prefix from the cluster's prefix index, and load), one replica per rank; replicas
    it does not name come last, together (Serve picks the shortest queue among them)."""

    def rank(self, candidate_replicas: list[RunningReplica],
             pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        by_id = {str(r.replica_id.unique_id): r for r in candidate_replicas}
        ranked = [[by_id[rid]] for rid in _ranking_of(pending_request) if rid in by_id]
        named = {id(rank[0]) for rank in ranked}
        rest = [r for r in candidate_replicas if id(r) not in named]
        return ranked + ([rest] if rest else [])


class KVHeadroomRouter(_PolicyRouter):
    """Decode: prefer replicas with the most free KV blocks (from their routing stats)."""

    def initialize_state(self, band: float = 0.1, **_: Any) -> None:
        self.band = band

    def rank(self, candidate_replicas: list[RunningReplica],
             pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        headroom = {}
        for replica in candidate_replicas:
            load = WorkerLoad.from_stats(replica.routing_stats or {})
            if load is not None:
                headroom[replica.replica_id] = KVHeadroom(load.num_free_blocks, load.num_blocks)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[rid] for rid in rank]
                for rank in rank_by_headroom(list(by_id), headroom, self.band) if rank]


class RoundRobinRouter(_PolicyRouter):
    """Each replica in turn: the baseline the smarter policies are compared against."""

    def initialize_state(self, **_: Any) -> None:
        self.turn = 0

    def rank(self, candidate_replicas: list[RunningReplica],
             pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self.turn += 1
        start = self.turn % len(ordered)
        # One replica per rank: Serve would pick the shortest queue within a shared rank.
        return [[r] for r in ordered[start:] + ordered[:start]]
