"""Receiver side of same-host reads: map a sender's exported KV cache and slots region (once per
sender session and region), check a transfer's SOURCE (or its slot's begin records) against
them, follow its read slot, and unmap once no copy can read them any more. Loop thread,
except `SourceMaps._claim` (a slot watcher's)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.errors import HandoffProtocolError
from pdserve.handoff.futex import FUTEX_AVAILABLE
from pdserve.handoff.inbound import InboundTransfer
from pdserve.handoff.kvcopy import joint_runs
from pdserve.handoff.piece_plan import row_nbytes
from pdserve.handoff.read_slots import (
    NUM_BELLS,
    NUM_SLOTS,
    REGION_BYTES,
    SlotBegin,
    identity,
)
from pdserve.handoff.sessions import SenderSession
from pdserve.handoff.slot_watch import ErrorHandler, RecordHandler, SlotWatcher
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.ucp_memory import PeerMemory, UcpMemoryError

log = logging.getLogger(__name__)
# A sender exports one cache; a few regions per session leave room for a restarted engine,
# and bound the address space a peer can make us map.
MAX_REGIONS_PER_SESSION = 4


@dataclass(frozen=True)
class SlotFeed:
    """Where a transfer's pieces and fence are announced: a slot of the sender's mapped slots
    region, the tag its records are sealed with, and the bell the sender rings."""

    memory: PeerMemory
    slot: int
    tag: int
    bell: int


@dataclass(frozen=True)
class ReadSource:
    """Where one transfer's KV is read from: the sender's cache rows mapped into this process
    (``[layers, 2, cache blocks, row bytes]``, over ``memory``), its block ids (int64,
    range-checked) and, if announced through shared memory, its slot."""

    rows: np.ndarray
    ids: np.ndarray
    dst_ids: np.ndarray  # the reserved blocks the pieces land in (int64)
    runs: list[tuple[int, int]]  # `joint_runs` of both id lists, found once per transfer
    memory: PeerMemory
    slot: SlotFeed | None = None


class SourceMaps:
    """Mappings of senders' exported caches and slots regions, and slot watchers, by session.
    ``lookup(transfer_id)``: the receiver's reservation with that id, for transfers a sender
    begins in a slot (`_claim`)."""

    def __init__(self, transport: HandoffTransport, on_record: RecordHandler,
                 on_error: ErrorHandler,
                 lookup: Callable[[int], InboundTransfer | None]) -> None:
        self._transport = transport
        self._on_record, self._on_error, self._lookup = on_record, on_error, lookup
        self._maps: dict[int, dict[tuple[bytes, int, int, bool], PeerMemory]] = {}
        self._watchers: dict[int, SlotWatcher] = {}
        self._count_lock = threading.Lock()
        self.num_slot_begun = 0  # transfers that began from their slot, before any frame

    def source_for(self, session: SenderSession, record: InboundTransfer,
                   body: dict[str, Any]) -> ReadSource:
        """Validate a SOURCE frame (HandoffProtocolError naming what is wrong) and map the
        region it names; reads then stay inside that region whatever the pieces claim."""
        layout, num_blocks = record.layout, record.num_blocks
        if not record.reads_offered:  # before anything is mapped (its cache may be on CUDA)
            raise HandoffProtocolError("SOURCE for a transfer whose ticket offered no reads")
        cache_blocks, raw_ids = body["cache_blocks"], body["blocks"]
        if not 0 < cache_blocks < 1 << 32:
            raise HandoffProtocolError(f"SOURCE names a cache of {cache_blocks} blocks")
        if len(raw_ids) != 4 * num_blocks:
            raise HandoffProtocolError(
                f"SOURCE lists {len(raw_ids) // 4} block ids, {num_blocks} were reserved")
        ids = np.frombuffer(raw_ids, dtype="<u4").astype(np.int64)
        if int(ids.max()) >= cache_blocks:
            raise HandoffProtocolError(
                f"SOURCE block id {int(ids.max())} outside the sender's {cache_blocks} blocks")
        nbytes = int(np.prod(_cache_shape(layout, cache_blocks)))
        peer = self._map(session, body["rkey"], body["address"], nbytes)
        return _read_source(record, ids, cache_blocks, peer, self._slot_feed(session, body))

    def _slot_feed(self, session: SenderSession, body: dict[str, Any]) -> SlotFeed | None:
        if not body["slots_rkey"]:
            return None  # pieces come as PIECE frames
        slot, tag, bell = body["slot"], body["slot_tag"], body["bell"]
        if not (0 <= slot < NUM_SLOTS and 0 <= bell < NUM_BELLS and 0 <= tag < 1 << 64):
            raise HandoffProtocolError(f"SOURCE names slot {slot}, bell {bell}, tag {tag}")
        if not FUTEX_AVAILABLE:
            raise HandoffProtocolError("read slots need futexes, which this platform lacks")
        memory = self._map(session, body["slots_rkey"], body["slots_address"], REGION_BYTES,
                           writable=True)
        return SlotFeed(memory, slot, tag, bell)

    def follow(self, session: SenderSession, record: InboundTransfer, feed: SlotFeed) -> None:
        """Watch ``record``'s slot (one watcher thread per session: one bell, one region)."""
        watcher = self._watchers.get(session.session_id)
        if watcher is None or not watcher.alive:  # a dead one's transfers end at their deadline
            watcher = SlotWatcher(f"pdserve-handoff-slots-{session.session_id:x}", feed.memory,
                                  feed.bell, self._on_record, self._on_error,
                                  functools.partial(self._claim, session, feed))
            self._watchers[session.session_id] = watcher
        elif watcher.memory is not feed.memory or watcher.bell != feed.bell:
            raise HandoffProtocolError("a sender session's slots must share one region and bell")
        watcher.follow(record, feed.slot, feed.tag)

    def _claim(self, session: SenderSession, feed: SlotFeed, slot: int, tag: int,
               begin: SlotBegin) -> InboundTransfer | None:
        """Watcher thread: start a transfer that ``session``'s sender began in ``slot`` if it
        is a live reservation of ours, still waiting for its BEGIN, and the begin records
        match it exactly (the checks of BEGIN and SOURCE, against a cache mapping the session
        already made). Anything else returns None: BEGIN and SOURCE frames then decide, with
        their errors (the sender skips them only for a slot we marked as started)."""
        record = self._lookup(begin.transfer_id)
        if (record is None or not record.reads_offered
                or begin.instance != self._transport.instance_id):
            return None  # (reads are offered for host caches only)
        layout = record.layout
        nbytes = int(np.prod(_cache_shape(layout, begin.cache_blocks)))
        regions = list(self._maps.get(session.session_id, {}).items())  # loop adds; a copy
        cache = next((peer for (_, address, size, writable), peer in regions
                      if address == begin.cache_address and size == nbytes and not writable),
                     None)
        ids = begin.block_ids
        if (cache is None or begin.num_blocks != record.num_blocks or not len(ids)
                or int(ids.max()) >= begin.cache_blocks
                or begin.identity != identity(record.request_id, layout.to_dict())):
            return None
        source = _read_source(record, ids, begin.cache_blocks, cache,
                              SlotFeed(feed.memory, slot, tag, feed.bell))
        with record.write_lock:
            if not record.begin_in_slot(session.session_id, source):
                return None
        with self._count_lock:
            self.num_slot_begun += 1
        return record

    def _map(self, session: SenderSession, rkey: bytes, address: int,
             nbytes: int, writable: bool = False) -> PeerMemory:
        """The session's mapping of a region (made once); the cache is mapped read-only, the
        slots region writable (a watcher rings its own bell word there)."""
        regions = self._maps.setdefault(session.session_id, {})
        key = (rkey, address, nbytes, writable)
        if key in regions:
            return regions[key]
        if len(regions) >= MAX_REGIONS_PER_SESSION:
            raise HandoffProtocolError(
                f"sender session already mapped {MAX_REGIONS_PER_SESSION} cache regions")
        endpoint = session.endpoint
        if not endpoint.done() or endpoint.cancelled() or endpoint.exception() is not None:
            raise HandoffProtocolError("no endpoint back to the sender to map its cache with")
        try:
            peer = self._transport.map_peer_memory(endpoint.result(), rkey, address, nbytes,
                                                   writable)
        except UcpMemoryError as exc:
            raise HandoffProtocolError(f"cannot map the sender's KV cache: {exc}") from exc
        regions[key] = peer
        log.debug("mapped %d bytes of sender session %x's KV cache", nbytes, session.session_id)
        return peer

    def forget(self, session_id: int) -> None:
        """Stop following a session's slots and unmap its regions (each once no copy and no
        watcher holds it). Call only when no live transfer of the session can read more."""
        watcher = self._watchers.pop(session_id, None)
        if watcher is not None:
            watcher.stop()
        for peer in self._maps.pop(session_id, {}).values():
            peer.close()

    def forget_all(self) -> None:
        for session_id in list(self._maps):
            self.forget(session_id)


def _cache_shape(layout: KVLayout, cache_blocks: int) -> tuple[int, int, int, int]:
    """A sender's exported cache as byte rows: ``[layers, 2, cache blocks, row bytes]``."""
    return (layout.num_local_layers, 2, cache_blocks, row_nbytes(layout))


def _read_source(record: InboundTransfer, ids: np.ndarray, cache_blocks: int,
                 cache: PeerMemory, feed: SlotFeed | None) -> ReadSource:
    """Where ``record`` reads from: ``ids`` (checked) of the mapped ``cache``."""
    dst_ids = record.block_ids.numpy()
    return ReadSource(cache.array.reshape(_cache_shape(record.layout, cache_blocks)), ids,
                      dst_ids, joint_runs(ids, dst_ids), cache, feed)
