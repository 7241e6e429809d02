"""How the router ranks replicas of each role: by the cached prefix the cluster's prefix index
reports and their load (prefill, and decode's prefix_affinity), or by KV headroom (decode).
Pure functions and one small table; the Serve glue is in `replica_routing.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

ReplicaT = TypeVar("ReplicaT", bound=Hashable)


class RecentRoutes:
    """Which replica each prompt's blocks (engine hashes) were just routed to, for
    ``ttl_s``: a prompt that arrives while its twin is still prefilling (before any KV
    event could say so) follows it. Bounded; never outlives the events that confirm it."""

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 100_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._routes: OrderedDict[bytes, tuple[Hashable, float]] = OrderedDict()

    def record(self, hashes: Sequence[bytes], replica: Hashable, now: float) -> None:
        for h in hashes:
            self._routes[h] = (replica, now + self.ttl_s)
            self._routes.move_to_end(h)
        while len(self._routes) > self.max_entries:
            self._routes.popitem(last=False)

    def depth(self, hashes: Sequence[bytes], replica: Hashable, now: float) -> int:
        """Leading blocks of ``hashes`` last routed to ``replica`` within the TTL."""
        for depth, h in enumerate(hashes):
            route = self._routes.get(h)
            if route is None or route[0] != replica or route[1] < now:
                return depth
        return len(hashes)

    def forget(self, replica: Hashable) -> None:
        for h in [h for h, (r, _) in self._routes.items() if r == replica]:
            del self._routes[h]


@dataclass(frozen=True)
class PrefixCost:
    """A replica's estimated prefill work for one prompt, in token-equivalents: the tokens
    it would compute, host-tier tokens at ``host_weight`` each (loading beats computing),
    and the prompt tokens already queued there."""

    num_compute_tokens: int
    num_host_tokens: int
    num_queued_tokens: int
    host_weight: float

    @property
    def total(self) -> float:
        return (self.num_compute_tokens + self.host_weight * self.num_host_tokens
                + self.num_queued_tokens)


def rank_by_prefix(replicas: Sequence[ReplicaT], costs: Mapping[ReplicaT, PrefixCost],
                   band_tokens: float) -> list[list[ReplicaT]]:
    """Cheapest first: replicas within ``band_tokens`` of the cheapest share the first rank
    (Serve picks the shortest queue among them), the rest follow one by one by cost.
    Replicas without a cost come last."""
    known = sorted((r for r in replicas if r in costs), key=lambda r: costs[r].total)
    unknown = [r for r in replicas if r not in costs]
    if not known:
        return [list(replicas)] if replicas else []
    best = costs[known[0]].total
    top = [r for r in known if costs[r].total <= best + band_tokens]
    rest = [[r] for r in known if costs[r].total > best + band_tokens]
    return [top, *rest] + ([unknown] if unknown else [])


@dataclass(frozen=True)
class KVHeadroom:
    num_free_blocks: int
    num_blocks: int

    @property
    def fraction(self) -> float:
        return self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


def rank_by_headroom(replicas: Sequence[ReplicaT], headroom: Mapping[ReplicaT, KVHeadroom],
                     band: float = 0.1) -> list[list[ReplicaT]]:
    """Replicas within `band` of the most free KV first (Serve then picks the shortest queue
    among them), the rest after, fullest last. Unknown headroom counts as fully free."""
    def free(r: ReplicaT) -> float:
        h = headroom.get(r)
        return 1.0 if h is None else h.fraction

    ordered = sorted(replicas, key=free, reverse=True)
    if not ordered:
        return []
    best = free(ordered[0])
    top = [r for r in ordered if free(r) >= best - band]
    rest = [r for r in ordered if free(r) < best - band]
    return [top, rest] if rest else [top]
