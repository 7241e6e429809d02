"""The cluster's prefix index: which replica holds which blocks in which tier, as their
workers' KV events say; what a prompt's contiguous cached prefix is on each replica.

Pure state (no sockets): `kv_event_feed.py` feeds it, the request routers read it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.kv.events import EventKind, Tier

_INDEXED = (Tier.DEVICE, Tier.HOST)


@dataclass(frozen=True)
class PrefixMatch:
    """A prompt's cached prefix on one replica, in blocks from position 0: the first
    ``num_device_blocks`` in device KV, and ``num_blocks`` in device or host KV."""

    num_device_blocks: int = 0
    num_blocks: int = 0

    @property
    def num_host_blocks(self) -> int:
        return self.num_blocks - self.num_device_blocks


@dataclass
class _Replica:
    layout: str
    seq: int
    blocks: dict[Tier, set[bytes]]


class PrefixIndex:
    """Per replica: its layout fingerprint, the last event number applied, its blocks.

    Contract: `reset` starts a replica from a snapshot; `apply` takes its events strictly in
    order and returns False on a gap (the replica's entries are dropped then: it needs a
    new snapshot); `drop` forgets a replica (gone, dead, or its feed broke). A replica is
    matched only against prompts hashed for its own layout.
    """

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[bytes, dict[str, set[Tier]]] = {}
        self.num_gaps = 0
        self.num_resets = 0

    @property
    def replica_ids(self) -> list[str]:
        return list(self._replicas)

    def seq(self, replica_id: str) -> int | None:
        replica = self._replicas.get(replica_id)
        return None if replica is None else replica.seq

    def num_blocks(self, replica_id: str, tier: Tier) -> int:
        replica = self._replicas.get(replica_id)
        return 0 if replica is None else len(replica.blocks.get(tier, ()))

    def reset(self, replica_id: str, layout: str, seq: int,
              blocks: dict[Tier, list[bytes]]) -> None:
        self.drop(replica_id)
        self.num_resets += 1
        self._replicas[replica_id] = _Replica(layout, seq, {t: set() for t in _INDEXED})
        for tier, hashes in blocks.items():
            for block_hash in hashes:
                self._add(replica_id, tier, block_hash)

    def apply(self, replica_id: str, first_seq: int,
              events: Sequence[tuple[EventKind, Tier, bytes]]) -> bool:
        replica = self._replicas.get(replica_id)
        if replica is None or first_seq != replica.seq + 1:
            self.num_gaps += 1
            self.drop(replica_id)
            return False
        for kind, tier, block_hash in events:
            if kind is EventKind.STORED:
                self._add(replica_id, tier, block_hash)
            else:
                self._remove(replica_id, tier, block_hash)
        replica.seq += len(events)
        return True

    def drop(self, replica_id: str) -> None:
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        for tier, hashes in replica.blocks.items():
            for block_hash in hashes:
                holders = self._holders.get(block_hash)
                if holders is not None and replica_id in holders:
                    holders[replica_id].discard(tier)
                    if not holders[replica_id]:
                        del holders[replica_id]
                    if not holders:
                        del self._holders[block_hash]

    def match(self, hashes: Sequence[bytes], replica_ids: Iterable[str],
              layout: str) -> dict[str, PrefixMatch]:
        """Each replica's contiguous cached prefix of a prompt whose block hashes (for
        ``layout``) are ``hashes``; replicas of another layout match nothing."""
        device = {r for r in replica_ids if r in self._replicas
                  and self._replicas[r].layout == layout}
        found = {r: [0, 0] for r in device}
        anywhere = set(device)
        for depth, block_hash in enumerate(hashes, start=1):
            holders = self._holders.get(block_hash, {})
            anywhere = {r for r in anywhere if r in holders}
            device = {r for r in device if Tier.DEVICE in holders.get(r, ())}
            if not anywhere:
                break
            for r in anywhere:
                found[r][1] = depth
            for r in device:
                found[r][0] = depth
        return {r: PrefixMatch(d, n) for r, (d, n) in found.items()}

    def check_integrity(self) -> None:
        """Raise AssertionError unless the per-hash and per-replica views agree."""
        pairs = {(h, r, t) for r, rep in self._replicas.items()
                 for t, hs in rep.blocks.items() for h in hs}
        mirrored = {(h, r, t) for h, holders in self._holders.items()
                    for r, tiers in holders.items() for t in tiers}
        assert pairs == mirrored, f"index views disagree on {len(pairs ^ mirrored)} entries"
        assert all(holders for holders in self._holders.values()), "an empty holder map"

    def _add(self, replica_id: str, tier: Tier, block_hash: bytes) -> None:
        if tier not in _INDEXED:
            return
        self._replicas[replica_id].blocks[tier].add(block_hash)
        self._holders.setdefault(block_hash, {}).setdefault(replica_id, set()).add(tier)

    def _remove(self, replica_id: str, tier: Tier, block_hash: bytes) -> None:
        if tier not in _INDEXED:
            return
        self._replicas[replica_id].blocks[tier].discard(block_hash)
        holders = self._holders.get(block_hash)
        if holders is None or replica_id not in holders:
            return
        holders[replica_id].discard(tier)
        if not holders[replica_id]:
            del holders[replica_id]
        if not holders:
            del self._holders[block_hash]
