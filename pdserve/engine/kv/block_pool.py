"""The KV block allocator: reference counts, the free queue and the prefix-cache map.

Metadata only: block ids index the KV tensor that the model runner owns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.engine.kv.events import KVEventLog, Tier
from pdserve.engine.kv.free_block_queue import FreeBlockQueue, KVBlock


class NoFreeBlocksError(RuntimeError):
    """`allocate` was asked for more blocks than are free; callers check first."""


class BlockPool:
    """Owns every block's lifetime.

    Contract:
    - A block with ``ref_count > 0`` is owned by that many requests and is never handed out
      or evicted. A block with ``ref_count == 0`` is in the free queue, and only then.
    - A full block whose KV is computed can be registered with `cache_block`. It keeps its
      hash while free, so a later request can `touch` it back (a prefix hit) until
      `allocate` evicts it. Free blocks count as free whether cached or not.
    - Eviction order: released cached blocks join the queue's tail (least recently used at
      the head); released uncached blocks join the head, since reusing them loses nothing.
      `allocate` takes from the head. Callers release a request's blocks last-first, so a
      prefix's tail blocks are evicted before the blocks its siblings share.
    - With an event log, every block registered in the cache map is reported stored in the
      device tier, and every eviction from it removed.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool,
                 events: KVEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"BlockPool needs num_blocks > 0, got {num_blocks}")
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.num_evictions = 0  # cumulative, for metrics

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now, evictable cached ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._blocks) - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        return self._blocks[block_id].block_hash is not None

    def cached_entry(self, block_id: int) -> tuple[bytes, tuple[int, ...]] | None:
        """The hash and tokens a cached block is registered under (None: not cached)."""
        block = self._blocks[block_id]
        if block.block_hash is None or block.token_ids is None:
            return None
        return block.block_hash, block.token_ids

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (evicting cached ones), ref 1 each."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks but only {len(self._free)} are free")
        block_ids: list[int] = []
        for _ in range(n):
            block = self._free.pop_front()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block_ids.append(block.block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix hit), taking free ones off the queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                self._free.remove(block)
            block.ref_count += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order; at zero it becomes free."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"release of block {block_id} that has no references")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.push_front(block)
                else:
                    self._free.push_back(block)

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> bool:
        """Register a referenced, full, computed block under its hash.

        Returns False (and changes nothing) if caching is off or another block already
        holds this hash: the duplicate simply stays uncached and is reused first once free.
        """
        block = self._blocks[block_id]
        if block.ref_count <= 0:
            raise ValueError(f"cache_block of block {block_id} that no request references")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return True
        if not self.enable_prefix_caching or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, Tier.DEVICE)
        return True

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block with this hash, only if it holds exactly these tokens."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block.block_id

    def check_integrity(self) -> None:
        """Raise AssertionError describing the first broken invariant, if any."""
        self._free.check_links()
        free_ids = {block.block_id for block in self._free}
        assert len(free_ids) == len(self._free), "a block appears twice in the free queue"
        for block in self._blocks:
            assert block.ref_count >= 0, f"{block!r} has a negative reference count"
            in_queue = block.block_id in free_ids
            assert in_queue == (block.ref_count == 0), (
                f"{block!r}: in free queue={in_queue} but ref_count={block.ref_count}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, (
                    f"{block!r} carries a hash the cache map does not point back to it with"
                )
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, (
                f"cache map entry points at {block!r} with another hash"
            )
        num_used = sum(1 for block in self._blocks if block.ref_count > 0)
        assert num_used + len(self._free) == self.num_blocks, (
            f"free {len(self._free)} + used {num_used} != total {self.num_blocks}"
        )

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash, Tier.DEVICE)
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1
