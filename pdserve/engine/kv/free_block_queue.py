"""The free KV blocks as a doubly linked list threaded through the block records.

O(1) push at either end, pop at the head, and removal from the middle (a prefix hit on a
free cached block); head-to-tail order is the eviction order.
"""

from __future__ import annotations

from collections.abc import Iterator


class KVBlock:
    """Bookkeeping of one physical KV block (no tensor data lives here).

    ``block_hash``/``token_ids`` are set iff the block is registered in the pool's prefix
    cache map; ``prev``/``next`` are set iff the block is in the free queue.
    """

    __slots__ = ("block_hash", "block_id", "next", "prev", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    @property
    def in_free_queue(self) -> bool:
        return self.prev is not None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of blocks with sentinel ends; head = evicted/reused first."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        # Sentinels (id -1) remove the empty-list special cases from every operation.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks:
            self.push_back(block)

    def __len__(self) -> int:
        return self._len

    def push_back(self, block: KVBlock) -> None:
        self._insert_between(block, self._tail.prev, self._tail)

    def push_front(self, block: KVBlock) -> None:
        self._insert_between(block, self._head, self._head.next)

    def pop_front(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("pop_front from an empty free block queue")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail; stops after len+1 steps so a corrupted (cyclic) list cannot hang."""
        node = self._head.next
        for _ in range(self._len + 1):
            if node is None or node is self._tail:
                return
            yield node
            node = node.next

    def check_links(self) -> None:
        """Raise AssertionError unless the links form one well-formed list of `len` blocks."""
        count = 0
        node = self._head
        while node.next is not self._tail:
            nxt = node.next
            assert nxt is not None, f"free queue broken after {node!r}"
            assert nxt.prev is node, f"free queue: {nxt!r}.prev is {nxt.prev!r}, expected {node!r}"
            count += 1
            assert count <= self._len, f"free queue longer than its length {self._len} (cycle?)"
            node = nxt
        assert self._tail.prev is node, "free queue: tail sentinel's prev is wrong"
        assert count == self._len, (
            f"free queue holds {count} blocks but its length says {self._len}"
        )

    def _insert_between(self, block: KVBlock, prev: KVBlock | None, nxt: KVBlock | None) -> None:
        if block.in_free_queue:
            raise ValueError(f"{block!r} is already in the free queue")
        assert prev is not None and nxt is not None
        block.prev, block.next = prev, nxt
        prev.next = block
        nxt.prev = block
        self._len += 1
