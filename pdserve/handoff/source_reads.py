"""Receiver side of same-host reads: map a sender's exported KV cache (once per sender session
and region), check a transfer's SOURCE against it, and unmap once no queued copy can read it.
Loop only."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.errors import HandoffProtocolError
from pdserve.handoff.piece_plan import row_nbytes
from pdserve.handoff.sessions import SenderSession
from pdserve.handoff.transport import HandoffTransport
from pdserve.handoff.ucp_memory import PeerMemory, UcpMemoryError

log = logging.getLogger(__name__)
# A sender exports one cache; a few regions per session leave room for a restarted engine,
# and bound the address space a peer can make us map.
MAX_REGIONS_PER_SESSION = 4


@dataclass(frozen=True)
class ReadSource:
    """Where one transfer's KV is read from: the sender's cache rows mapped into this process
    (``[layers, 2, cache blocks, row bytes]``) and its block ids (int64, range-checked)."""

    rows: np.ndarray
    ids: np.ndarray


class SourceMaps:
    """Mappings of senders' exported caches, by session."""

    def __init__(self, transport: HandoffTransport) -> None:
        self._transport = transport
        self._maps: dict[int, dict[tuple[bytes, int, int], PeerMemory]] = {}

    def source_for(self, session: SenderSession, layout: KVLayout, num_blocks: int,
                   body: dict[str, Any]) -> ReadSource:
        """Validate a SOURCE frame (HandoffProtocolError naming what is wrong) and map the
        region it names; reads then stay inside that region whatever the pieces claim."""
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
        row = row_nbytes(layout)
        shape = (layout.num_local_layers, 2, cache_blocks, row)
        nbytes = int(np.prod(shape))
        peer = self._map(session, body["rkey"], body["address"], nbytes)
        return ReadSource(peer.array.reshape(shape), ids)

    def _map(self, session: SenderSession, rkey: bytes, address: int,
             nbytes: int) -> PeerMemory:
        regions = self._maps.setdefault(session.session_id, {})
        key = (rkey, address, nbytes)
        if key in regions:
            return regions[key]
        if len(regions) >= MAX_REGIONS_PER_SESSION:
            raise HandoffProtocolError(
                f"sender session already mapped {MAX_REGIONS_PER_SESSION} cache regions")
        endpoint = session.endpoint
        if not endpoint.done() or endpoint.cancelled() or endpoint.exception() is not None:
            raise HandoffProtocolError("no endpoint back to the sender to map its cache with")
        try:
            peer = self._transport.map_peer_memory(endpoint.result(), rkey, address, nbytes)
        except UcpMemoryError as exc:
            raise HandoffProtocolError(f"cannot map the sender's KV cache: {exc}") from exc
        regions[key] = peer
        log.debug("mapped %d bytes of sender session %x's KV cache", nbytes, session.session_id)
        return peer

    def forget(self, session_id: int) -> None:
        """Unmap a session's regions once the payload work queued so far (copies that may read
        them) has run. Call only when no live transfer of the session can queue more."""
        for peer in self._maps.pop(session_id, {}).values():
            self._transport.after_payload_work(peer.close)

    def forget_all(self) -> None:
        for session_id in list(self._maps):
            self.forget(session_id)
