"""How the router ranks replicas of each role: prefix affinity for prefill, KV headroom for
decode. Pure functions and one small table; the Serve glue is in `replica_routing.py`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

ReplicaT = TypeVar("ReplicaT", bound=Hashable)


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the prompt's first full blocks: equal prefixes give equal chains."""
    hashes: list[bytes] = []
    parent = b""
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block),
                                 digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixOwnerTable:
    """Remembers which replica last prefilled each prefix block (LRU-bounded).

    The router's own picture of the replicas' prefix caches: cheap, never exact (a replica
    may have evicted the blocks), so it only steers, it never guarantees a hit.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._owners: OrderedDict[bytes, Hashable] = OrderedDict()

    def record(self, hashes: Sequence[bytes], replica: Hashable) -> None:
        for h in hashes:
            self._owners[h] = replica
            self._owners.move_to_end(h)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def owner(self, hashes: Sequence[bytes], live: set[Hashable]) -> tuple[Hashable | None, int]:
        """The live replica holding the longest recorded prefix, and its length in blocks."""
        for depth in range(len(hashes), 0, -1):
            replica = self._owners.get(hashes[depth - 1])
            if replica is not None and replica in live:
                return replica, depth
        return None, 0

    def forget(self, replica: Hashable) -> None:
        for h in [h for h, r in self._owners.items() if r == replica]:
            del self._owners[h]


def rank_by_affinity(replicas: Sequence[ReplicaT], owner: ReplicaT | None,
                     queue_lens: Mapping[ReplicaT, int],
                     max_imbalance: int) -> list[list[ReplicaT]]:
    """The prefix owner first, unless its queue is `max_imbalance` longer than the shortest
    (a cache hit is not worth waiting behind a backlog); then everyone else."""
    if owner is None or owner not in replicas:
        return [list(replicas)]
    others = [r for r in replicas if r != owner]
    shortest = min((queue_lens.get(r, 0) for r in replicas), default=0)
    if queue_lens.get(owner, 0) - shortest > max_imbalance:
        return [others, [owner]] if others else [[owner]]
    return [[owner], others] if others else [[owner]]


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
