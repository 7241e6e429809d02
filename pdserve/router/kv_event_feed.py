"""The ingress's end of the KV event plane: one subscription per worker replica, feeding the
`PrefixIndex`, and the prompt's block hashes in each worker's own hash chain.

A replica is followed from its snapshot on; a gap, a broken frame or a closed connection
drops its entries at once and the subscription reconnects (a new snapshot).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.engine.kv.block_hash import hash_full_blocks
from pdserve.planes.kv_event_wire import (
    EVENT_PLANE,
    EventBatch,
    Snapshot,
    WorkerIdentity,
    parse_message,
)
from pdserve.planes.link import FrameReader, PlaneError
from pdserve.router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

RETRY_S = 0.5


@dataclass
class _Follow:
    address: str
    task: asyncio.Task[None]


class KVEventFeed:
    """Follows the replicas `sync` names (replica id -> "host:port" of its event plane)."""

    def __init__(self, token: str, index: PrefixIndex | None = None) -> None:
        self._token = token
        self.index = index if index is not None else PrefixIndex()
        self.identities: dict[str, WorkerIdentity] = {}
        self._follows: dict[str, _Follow] = {}
        self.num_connects = 0

    def sync(self, addresses: Mapping[str, str]) -> None:
        """Follow exactly these replicas (on the running loop); the others are dropped."""
        for replica_id in set(self._follows) - set(addresses):
            self.forget(replica_id)
        for replica_id, address in addresses.items():
            current = self._follows.get(replica_id)
            if not address or (current is not None and current.address == address):
                continue
            if current is not None:
                self.forget(replica_id)
            task = asyncio.get_running_loop().create_task(self._follow(replica_id, address))
            self._follows[replica_id] = _Follow(address, task)

    def forget(self, replica_id: str) -> None:
        follow = self._follows.pop(replica_id, None)
        if follow is not None:
            follow.task.cancel()
        self._drop(replica_id)

    def prompt_hashes(self, token_ids: Sequence[int], max_blocks: int,
                      ) -> dict[str, tuple[str, list[bytes], int]]:
        """Per followed replica: (layout fingerprint, the prompt's block hashes in its chain,
        block size); one hash chain per distinct (salt, block size)."""
        chains: dict[tuple[str, int], list[bytes]] = {}
        found = {}
        for replica_id, ident in self.identities.items():
            key = (ident.hash_salt, ident.block_size)
            if key not in chains:
                usable = token_ids[:max_blocks * ident.block_size]
                chains[key] = hash_full_blocks(usable, ident.block_size, ident.hash_salt)
            found[replica_id] = (ident.layout_fingerprint, chains[key], ident.block_size)
        return found

    async def close(self) -> None:
        for replica_id in list(self._follows):
            follow = self._follows.pop(replica_id)
            follow.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follow.task
            self._drop(replica_id)

    def _drop(self, replica_id: str) -> None:
        self.index.drop(replica_id)
        self.identities.pop(replica_id, None)

    async def _follow(self, replica_id: str, address: str) -> None:
        host, _, port = address.rpartition(":")
        while True:
            try:
                await self._read(replica_id, host, int(port))
            except (OSError, asyncio.IncompleteReadError, PlaneError,
                    TimeoutError) as exc:
                logger.debug("KV events of %s stopped: %s", replica_id, exc)
            self._drop(replica_id)
            await asyncio.sleep(RETRY_S)

    async def _read(self, replica_id: str, host: str, port: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            key = await EVENT_PLANE.connect(reader, writer, self._token)
            frames = FrameReader(key, EVENT_PLANE)
            self.num_connects += 1
            while True:
                frame = parse_message(await frames.read(reader))
                if isinstance(frame, Snapshot):
                    self.identities[replica_id] = frame.identity
                    self.index.reset(replica_id, frame.identity.layout_fingerprint,
                                     frame.snapshot.seq, frame.snapshot.blocks)
                elif (isinstance(frame, EventBatch)
                      and not self.index.apply(replica_id, frame.first_seq, frame.events)):
                    raise PlaneError(f"event gap from {replica_id}: resync")
        finally:
            writer.transport.abort()
