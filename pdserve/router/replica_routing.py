"""Ray Serve request routers for the two roles, built on `pairing.py`'s rankings.

They run inside the ingress's deployment handles. Serve does the probing and backoff: a
router ranks candidates, splitting ties by the requests it has in flight on each replica.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
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


# A choice counts against its replica until Serve reports the send, or for this long: a burst
# asks for many choices before the first send is reported.
RESERVATION_S = 1.0


class InFlight:
    """Requests this router sent each replica and has not seen complete, plus its choices of
    the last `RESERVATION_S` whose send Serve has not reported yet."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sent: dict[Hashable, int] = {}
        self._reserved: dict[Hashable, deque[float]] = {}

    def count(self, replica: Hashable) -> int:
        held = self._reserved.get(replica)
        now = self._clock()
        while held and held[0] <= now - RESERVATION_S:
            held.popleft()
        return self._sent.get(replica, 0) + (len(held) if held else 0)

    def reserve(self, replica: Hashable) -> None:
        self._reserved.setdefault(replica, deque()).append(self._clock())

    def sent(self, replica: Hashable) -> None:
        self._sent[replica] = self._sent.get(replica, 0) + 1
        held = self._reserved.get(replica)
        if held:
            held.popleft()

    def completed(self, replica: Hashable) -> None:
        if self._sent.get(replica, 0) > 0:
            self._sent[replica] -= 1

    def keep_only(self, replicas: set[Hashable]) -> None:
        """Forget replicas that are no longer candidates (stopped or dead)."""
        for table in (self._sent, self._reserved):
            for gone in [r for r in table if r not in replicas]:
                del table[gone]


class _PolicyRouter(FIFOMixin, RequestRouter):
    """A call that names a ``pinned_replica`` goes there; the others by the policy's `rank`,
    each rank of several replicas split one per rank by fewest requests in flight.

    Why split ties here: Serve picks within a rank by probed queue lengths, and a burst's
    choices all see the same probes, so every request of the burst lands on one replica."""

    def initialize_state(self, **_: Any) -> None:
        self.in_flight = InFlight()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        ranks = _pinned(candidate_replicas, pending_request)
        if ranks is None:
            ranks = self.rank(candidate_replicas, pending_request) if candidate_replicas else []
        ranks = [[r] for rank in ranks
                 for r in sorted(rank, key=lambda r: self.in_flight.count(r.replica_id))]
        if ranks:
            self.in_flight.reserve(ranks[0][0].replica_id)
        return ranks

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.in_flight.keep_only({r.replica_id for r in replicas})

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight.sent(replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.in_flight.completed(replica_id)

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
        super().initialize_state()
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
        super().initialize_state()
        self.turn = 0

    def rank(self, candidate_replicas: list[RunningReplica],
             pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self.turn += 1
        start = self.turn % len(ordered)
        # One replica per rank: Serve would pick the shortest queue within a shared rank.
        return [[r] for r in ordered[start:] + ordered[:start]]
