"""Write-back of released cached blocks into the tiers beside the device: which device blocks
each copy pins, and which copies wait to start (the host tier's, the shared store's).

Metadata only: `kv_tiers.py` runs the copies and reports their ends here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from pdserve.engine.kv.block_pool import BlockPool
from pdserve.engine.kv.host_block_pool import HostBlockPool

# Hashes this worker put into the shared store, remembered so a block is not put again.
MAX_KNOWN_PUTS = 1 << 18


class WriteBack:
    """Contract: a cached block whose last reference went (`on_release`) gets one reference
    per copy that reads it (a host store, a store put) until that copy's `finish_*`: it is
    never evicted or overwritten while a copy reads it, and eviction never waits for a copy
    (the copy starts when the block is released, not when it is evicted)."""

    def __init__(self, pool: BlockPool, host_pool: HostBlockPool | None,
                 puts: bool = False) -> None:
        self._pool, self.host_pool, self.puts = pool, host_pool, puts
        self._host_stores: dict[int, int] = {}  # device block -> host block it is copied into
        self._putting: dict[int, bytes] = {}  # device block -> hash it is put under
        self._pending_stores: list[tuple[int, int]] = []
        self._pending_puts: list[tuple[int, bytes]] = []
        self._known_puts: OrderedDict[bytes, None] = OrderedDict()

    @property
    def has_pending(self) -> bool:
        return bool(self._pending_stores or self._pending_puts)

    @property
    def num_pinned(self) -> int:
        return len(self._host_stores) + len(self._putting)

    def pins(self) -> Counter[int]:
        """References the copies hold, per device block (for the integrity check)."""
        return Counter(list(self._host_stores) + list(self._putting))

    def on_release(self, block_ids: Iterable[int]) -> None:
        if self.host_pool is None and not self.puts:
            return  # no tier beside the device: nothing to copy
        for block_id in block_ids:
            if self._pool.ref_count(block_id):
                continue
            entry = self._pool.cached_entry(block_id)
            if entry is None:
                continue
            block_hash, tokens = entry
            if self.host_pool is not None and block_id not in self._host_stores:
                host_id = self.host_pool.begin_store(block_hash, tokens)
                if host_id is not None:
                    self._pool.touch([block_id])
                    self._host_stores[block_id] = host_id
                    self._pending_stores.append((block_id, host_id))
            if (self.puts and block_id not in self._putting
                    and block_hash not in self._known_puts):
                self._pool.touch([block_id])
                self._putting[block_id] = block_hash
                self._pending_puts.append((block_id, block_hash))

    def take_host_stores(self) -> list[tuple[int, int]]:
        """(device block, host block) pairs to copy, each handed out once."""
        pending, self._pending_stores = self._pending_stores, []
        return pending

    def take_puts(self) -> list[tuple[int, bytes]]:
        """(device block, hash) pairs to put into the shared store, each handed out once."""
        pending, self._pending_puts = self._pending_puts, []
        return pending

    def finish_host_store(self, device_id: int, host_id: int, digest: int | None) -> None:
        """The copy of ``device_id`` into ``host_id`` ended (digest None: it failed)."""
        assert self.host_pool is not None
        if self._host_stores.pop(device_id, None) != host_id:
            raise ValueError(f"device block {device_id} is not being stored in {host_id}")
        self.host_pool.finish_store(host_id, digest)
        self._pool.release([device_id])

    def finish_put(self, device_id: int, ok: bool) -> None:
        block_hash = self._putting.pop(device_id)
        if ok:
            self._known_puts[block_hash] = None
            if len(self._known_puts) > MAX_KNOWN_PUTS:
                self._known_puts.popitem(last=False)
        self._pool.release([device_id])

    def forget_puts(self) -> None:
        """The store lost what it held (its master restarted): put blocks again."""
        self._known_puts.clear()
