"""The host tier's block allocator: which host block holds which cached block, which copies
read or write them, and LRU eviction. Metadata only (the bytes live in `engine/tiers/host.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.kv.events import KVEventLog, Tier


@dataclass
class _HostBlock:
    block_hash: bytes | None = None  # set while writing and while ready
    token_ids: tuple[int, ...] | None = None
    digest: int | None = None  # of the bytes as written; set once ready
    num_readers: int = 0  # copies reading it into device blocks
    writing: bool = False  # a copy is writing it from a device block


class HostBlockPool:
    """Owns every host block's lifetime.

    Contract:
    - A block is FREE, WRITING (`begin_store` .. `finish_store`), or READY (holds a hash,
      found by `lookup`). Only READY blocks are found, read, or evicted.
    - A READY block with readers (`begin_read` .. `end_read`) is never evicted or
      overwritten; one without readers sits in the LRU queue and `begin_store` may evict it.
    - A WRITING block is never handed out again until `finish_store` ends its write.
    - With an event log, a block that becomes READY is reported stored in the host tier, an
      evicted one removed.
    """

    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"HostBlockPool needs num_blocks > 0, got {num_blocks}")
        self._blocks = [_HostBlock() for _ in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # READY, unread; head evicted first
        self._ready: dict[bytes, int] = {}
        self._writing: dict[bytes, int] = {}
        self.events = events
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._ready)

    @property
    def num_busy_blocks(self) -> int:
        """Blocks a copy reads or writes now (0 when the tier is idle)."""
        return len(self._writing) + sum(1 for b in self._blocks if b.num_readers)

    def holds(self, block_hash: bytes) -> bool:
        """Whether the hash is READY or being written (no second copy is worth starting)."""
        return block_hash in self._ready or block_hash in self._writing

    def begin_store(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """A host block to write ``block_hash``'s KV into, evicting the least recently used
        unread block when none is free; None when the hash is held already or every block
        is busy."""
        if self.holds(block_hash):
            return None
        if self._free:
            host_id = self._free.pop()
        elif self._lru:
            host_id, _ = self._lru.popitem(last=False)
            self._evict(host_id)
        else:
            return None
        block = self._blocks[host_id]
        block.block_hash, block.token_ids, block.writing = block_hash, tuple(token_ids), True
        self._writing[block_hash] = host_id
        return host_id

    def finish_store(self, host_id: int, digest: int | None) -> None:
        """The write of ``host_id`` ended: with a digest it is READY, without (the copy
        failed) it is FREE again."""
        block = self._blocks[host_id]
        if not block.writing or block.block_hash is None:
            raise ValueError(f"finish_store of host block {host_id} that is not being written")
        del self._writing[block.block_hash]
        block.writing = False
        if digest is None:
            self._clear(host_id)
            self._free.append(host_id)
            return
        block.digest = digest
        self._ready[block.block_hash] = host_id
        self._lru[host_id] = None
        if self.events is not None:
            self.events.stored(block.block_hash, Tier.HOST)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The READY host block with this hash, only if it holds exactly these tokens."""
        host_id = self._ready.get(block_hash)
        if host_id is None or self._blocks[host_id].token_ids != tuple(token_ids):
            return None
        return host_id

    def digest(self, host_id: int) -> int:
        digest = self._blocks[host_id].digest
        if digest is None:
            raise ValueError(f"host block {host_id} is not ready")
        return digest

    def begin_read(self, host_ids: Iterable[int]) -> None:
        """A copy starts reading these READY blocks: none is evicted until `end_read`."""
        for host_id in host_ids:
            block = self._blocks[host_id]
            if block.digest is None:
                raise ValueError(f"begin_read of host block {host_id} that is not ready")
            block.num_readers += 1
            self._lru.pop(host_id, None)

    def end_read(self, host_ids: Iterable[int]) -> None:
        """The copy is done with them; unread, they become the most recently used."""
        for host_id in host_ids:
            block = self._blocks[host_id]
            if block.num_readers <= 0:
                raise ValueError(f"end_read of host block {host_id} that no copy reads")
            block.num_readers -= 1
            if block.num_readers == 0:
                self._lru[host_id] = None

    def drop(self, host_id: int) -> None:
        """Forget a READY, unread block whose bytes failed verification."""
        block = self._blocks[host_id]
        if block.digest is None or block.num_readers:
            raise ValueError(f"drop of host block {host_id} that is not ready and unread")
        self._lru.pop(host_id, None)
        self._evict(host_id)
        self._free.append(host_id)

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is free twice"
        for host_id, block in enumerate(self._blocks):
            ready = block.digest is not None
            states = [host_id in free, block.writing, ready]
            assert sum(states) == 1, f"host block {host_id}: free/writing/ready = {states}"
            assert block.num_readers >= 0, f"host block {host_id} has negative readers"
            if host_id in free:
                assert block.block_hash is None and block.num_readers == 0, (
                    f"free host block {host_id} holds a hash or readers")
            if block.writing:
                assert self._writing.get(block.block_hash or b"") == host_id, (
                    f"host block {host_id} writes a hash the map does not point back with")
            if ready:
                assert self._ready.get(block.block_hash or b"") == host_id, (
                    f"host block {host_id} is ready under a hash the map does not hold")
                assert (host_id in self._lru) == (block.num_readers == 0), (
                    f"host block {host_id}: in LRU={host_id in self._lru}, "
                    f"readers={block.num_readers}")
            else:
                assert block.num_readers == 0 and host_id not in self._lru, (
                    f"host block {host_id} is read or queued while not ready")
        assert len(self._ready) + len(self._writing) + len(free) == self.num_blocks, (
            "host blocks are lost: ready + writing + free != total")

    def _evict(self, host_id: int) -> None:
        """Unregister a READY block; the caller reuses it or puts it on the free list."""
        block = self._blocks[host_id]
        assert block.block_hash is not None
        del self._ready[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash, Tier.HOST)
        self.num_evictions += 1
        self._clear(host_id)

    def _clear(self, host_id: int) -> None:
        block = self._blocks[host_id]
        block.block_hash = block.token_ids = block.digest = None
        block.num_readers = 0
