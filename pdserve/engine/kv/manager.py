"""Per-request block tables on top of the block pool, and prefix-cache lookups.

The only interface the scheduler uses to reach KV blocks; the pool stays private.
"""

from __future__ import annotations

import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.kv.block_hash import hash_full_blocks
from pdserve.engine.kv.block_pool import BlockPool
from pdserve.engine.kv.events import KVEventLog
from pdserve.engine.kv.host_block_pool import HostBlockPool
from pdserve.engine.kv.write_back import WriteBack
from pdserve.engine.request import Request


@dataclass
class _BlockTable:
    """The blocks one request owns, in position order."""

    # Machine ints (append-only until the request lets go): a step's block table copies them
    # as bytes, where a list's ints would each be converted (`block_table`).
    block_ids: array.array[int] = field(default_factory=lambda: array.array("q"))
    num_registered: int = 0  # leading blocks already offered to the prefix cache


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Which blocks hold which request's KV.

    Lifetimes: a request owns blocks from its first successful `allocate_slots` until
    `free`. Every request given to `find_cached_prefix` or `allocate_slots` must end with
    `free`, which also drops its memoized block hashes. Block ``i`` of a request holds the
    KV of token positions ``[i * block_size, (i + 1) * block_size)``.

    With a host pool or store puts: a cached block whose last reference goes (`free`) is
    pinned by each copy into another tier until it ends (`write_back`). Host blocks a load
    reads are marked read by the caller (`host_pool.begin_read`) until its copy ended.
    """

    def __init__(
        self, num_blocks: int, block_size: int, salt: str, enable_prefix_caching: bool,
        events: KVEventLog | None = None, host_pool: HostBlockPool | None = None,
        store_puts: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.salt = salt
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks, enable_prefix_caching, events)
        self.host_pool = host_pool if enable_prefix_caching else None
        self._tables: dict[str, _BlockTable] = {}
        self._hashes: dict[str, list[bytes]] = {}  # memo; block contents never change
        self._pins: dict[str, list[int]] = {}  # cached blocks another worker reads, by pin id
        self.write_back = WriteBack(self._pool, self.host_pool, store_puts)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._pool.num_cached_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it owns none)."""
        table = self._tables.get(request_id)
        return table.block_ids.tolist() if table else []

    def block_table(self, request_id: str) -> array.array[int]:
        """`block_ids` as int64 machine ints: what a step's attention metadata is built of."""
        table = self._tables.get(request_id)
        return array.array("q", table.block_ids) if table else array.array("q")

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Leading cached blocks matching the request's tokens, and the tokens they cover.

        Never covers the last token, which must be computed so its logits exist. Nothing is
        referenced yet: pass the ids to `allocate_slots` in the same scheduling step.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        block_ids: list[int] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
            block_id = self._pool.lookup(block_hash, tokens)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def find_host_continuation(self, request: Request, num_device_blocks: int) -> list[int]:
        """Host blocks holding the request's blocks right after its ``num_device_blocks``
        cached ones, contiguous, never covering the last token (like `find_cached_prefix`)."""
        if self.host_pool is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        host_ids: list[int] = []
        for i in range(num_device_blocks, min(max_blocks, len(hashes))):
            tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
            host_id = self.host_pool.lookup(hashes[i], tokens)
            if host_id is None:
                break
            host_ids.append(host_id)
        return host_ids

    def block_hashes(self, request: Request, start: int, end: int) -> list[bytes]:
        """The chained hashes of the request's full blocks ``[start, end)`` (fewer when it has
        fewer full blocks); what the shared store keys its blocks by."""
        return self._block_hashes(request, end)[start:end]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Make the request own blocks for its computed tokens plus ``num_new_tokens``.

        With ``cached_block_ids`` (from `find_cached_prefix`, first allocation only) the
        computed tokens are the ones those blocks cover, and they get one more reference.
        Returns the newly allocated block ids, or None if they do not fit (nothing changed).
        """
        table = self._tables.get(request.request_id)
        if cached_block_ids:
            if table is not None and table.block_ids:
                raise ValueError(
                    f"request {request.request_id}: cached blocks after blocks were allocated"
                )
            num_computed = len(cached_block_ids) * self.block_size
        else:
            num_computed = request.num_computed_tokens
        num_owned = len(table.block_ids) if table else 0
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_needed - num_owned - len(cached_block_ids))
        # Touching a free cached hit takes it off the free queue: it cannot also be handed out.
        num_free_hits = sum(1 for b in cached_block_ids if self._pool.ref_count(b) == 0)
        if num_new_blocks > self._pool.num_free_blocks - num_free_hits:
            return None
        if table is None:
            table = self._tables[request.request_id] = _BlockTable()
        self._pool.touch(cached_block_ids)  # before allocate, so it cannot evict them
        new_block_ids = self._pool.allocate(num_new_blocks)
        table.block_ids.extend(cached_block_ids)
        table.block_ids.extend(new_block_ids)
        table.num_registered = max(table.num_registered, len(cached_block_ids))
        return new_block_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table.block_ids))
        if num_full <= table.num_registered:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(table.num_registered, num_full):
            tokens = request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size)
            self._pool.cache_block(table.block_ids[i], hashes[i], tokens)
        table.num_registered = num_full

    def free(self, request: Request) -> None:
        """Release every block the request owns, last block first (evicted first)."""
        self._hashes.pop(request.request_id, None)
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            self._pool.release(reversed(table.block_ids))
            self.write_back.on_release(table.block_ids)

    @property
    def num_pinned_for_peers(self) -> int:
        return sum(len(ids) for ids in self._pins.values())

    def pin_cached(self, pin_id: str, token_ids: Sequence[int],
                   first_block: int) -> list[int] | None:
        """The cached device blocks holding blocks ``[first_block, len(token_ids) //
        block_size)`` of ``token_ids``, each with one more reference under ``pin_id`` (another
        worker reads them: no eviction) until `unpin`; None, nothing pinned, when any of them
        is not cached."""
        bs = self.block_size
        num_blocks = len(token_ids) // bs
        if not self.enable_prefix_caching or pin_id in self._pins or first_block >= num_blocks:
            return None
        hashes = hash_full_blocks(token_ids[:num_blocks * bs], bs, self.salt)
        block_ids: list[int] = []
        for i in range(first_block, num_blocks):
            block_id = self._pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs])
            if block_id is None:
                return None
            block_ids.append(block_id)
        self._pool.touch(block_ids)
        self._pins[pin_id] = block_ids
        return block_ids

    def held_in_host_tier(self, token_ids: Sequence[int], first_block: int) -> bool:
        """Whether every block ``[first_block, len(token_ids) // block_size)`` of
        ``token_ids`` is cached in device KV or the host tier (a prefix request for them would
        load, not compute)."""
        bs = self.block_size
        num_blocks = len(token_ids) // bs
        if self.host_pool is None or not self.enable_prefix_caching or first_block >= num_blocks:
            return False
        hashes = hash_full_blocks(token_ids[:num_blocks * bs], bs, self.salt)
        return all(self._pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs]) is not None
                   or self.host_pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs])
                   is not None for i in range(first_block, num_blocks))

    def unpin(self, pin_id: str) -> None:
        """Drop `pin_cached`'s references (no-op for an unknown pin)."""
        block_ids = self._pins.pop(pin_id, None)
        if block_ids:
            self._pool.release(reversed(block_ids))
            self.write_back.on_release(block_ids)

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the tables (and peer pins)
        that hold it."""
        self._pool.check_integrity()
        if self.host_pool is not None:
            self.host_pool.check_integrity()
        holders: Counter[int] = self.write_back.pins()
        for block_ids in self._pins.values():
            holders.update(block_ids)
        for request_id, table in self._tables.items():
            assert len(set(table.block_ids)) == len(table.block_ids), (
                f"request {request_id} holds a block twice: {table.block_ids}"
            )
            holders.update(table.block_ids)
        for block_id in range(self._pool.num_blocks):
            assert self._pool.ref_count(block_id) == holders[block_id], (
                f"block {block_id}: ref_count {self._pool.ref_count(block_id)} but "
                f"{holders[block_id]} block tables hold it"
            )

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first ``num_blocks`` full blocks, extending the memo."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_blocks = min(num_blocks, request.num_tokens // self.block_size)
        if num_blocks > len(hashes):
            tokens = request.token_ids_slice(0, num_blocks * self.block_size)
            hashes[:] = hash_full_blocks(tokens, self.block_size, self.salt, known=hashes)
        return hashes
