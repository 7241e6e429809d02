"""Prefill side of same-host reads: the exported KV cache and its slots region (`SourceOffer`),
which transfers may be read from it, how their pieces are planned and announced, and the
SOURCE frame that tells the receiver where to read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.futex import FUTEX_AVAILABLE
from pdserve.handoff.piece_plan import (
    READ_MIN_PIECE_BYTES,
    SLOT_MIN_PIECE_BYTES,
    PieceSpec,
    plan_pieces,
)
from pdserve.handoff.read_slots import (
    MAX_SLOT_RECORDS,
    REGION_BYTES,
    SlotBegin,
    SlotLease,
    SlotTable,
    identity,
    num_begin_records,
)
from pdserve.handoff.ticket import HandoffTicket
from pdserve.handoff.ucp_memory import UcpMemoryError
from pdserve.handoff.wire import MAX_SOURCE_BLOCKS

if TYPE_CHECKING:
    from pdserve.handoff.transport import HandoffTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceOffer:
    """Where a same-host receiver reads a transfer's KV itself: the exported cache's region
    (rkey), the cache's address in this process and its number of blocks, and the slots
    region its pieces are announced in (None: PIECE frames)."""

    rkey: bytes
    address: int
    cache_blocks: int
    cache: torch.Tensor  # the exported cache; `send_layer` must be given this one
    slots: SlotTable | None = None

    @classmethod
    def export(cls, transport: HandoffTransport, cache: torch.Tensor,
               slots: SlotTable | None) -> SourceOffer | None:
        """An offer for ``cache`` if it lies in memory from `share_host_memory` (else None)."""
        region = transport.shared_region(cache)
        if region is None or not cache.is_contiguous() or cache.dim() != 6:
            return None
        return cls(region.rkey, cache.data_ptr(), cache.shape[2], cache,
                   slots if slots is not None else share_slots(transport))

    def serves(self, ticket: HandoffTicket, layout: KVLayout, host: str) -> bool:
        """Whether ``ticket``'s receiver can read this cache (same host, asked to, fits)."""
        return (ticket.reads_source and ticket.receiver_host == host
                and ticket.num_blocks <= MAX_SOURCE_BLOCKS
                and tuple(self.cache.shape) == layout.cache_shape(self.cache_blocks)
                and self.cache.dtype == layout.torch_dtype)

    def plan(self, ticket: HandoffTicket, layout: KVLayout, layers_per_piece: int | None,
             allow_slots: bool, corrupt_record: int | None = None,
             ) -> tuple[list[PieceSpec], SlotLease | None]:
        """The read pieces and, if one is free and they fit, the slot announcing them."""
        plan = plan_pieces(layout, ticket.num_blocks, SLOT_MIN_PIECE_BYTES,
                           ticket.max_piece_bytes, layers_per_piece)
        slot = None
        fits = len(plan) + num_begin_records(ticket.num_blocks) <= MAX_SLOT_RECORDS
        if self.slots is not None and allow_slots and fits:
            slot = self.slots.lease(ticket.receiver_address, ticket.transfer_id,
                                    ticket.num_blocks, corrupt_record)
        if slot is None:  # announced by PIECE frames: fewer, larger pieces
            plan = plan_pieces(layout, ticket.num_blocks, READ_MIN_PIECE_BYTES,
                               ticket.max_piece_bytes, layers_per_piece)
        return plan, slot

    def slot_begin(self, ticket: HandoffTicket, layout: KVLayout,
                   block_ids: np.ndarray) -> SlotBegin:
        """The begin records' content: BEGIN and SOURCE for a receiver watching the slots."""
        return SlotBegin(ticket.transfer_id, ticket.num_blocks, self.cache_blocks, self.address,
                         identity(ticket.request_id, layout.to_dict()),
                         ticket.receiver_instance, block_ids)

    def source_body(self, transfer_id: int, block_ids: torch.Tensor, slot: SlotLease | None,
                    address_shift: int = 0) -> dict[str, object]:
        """The SOURCE frame's body (``address_shift``: tests, a lying sender)."""
        slots = self.slots if slot is not None else None
        return {"tid": transfer_id, "rkey": self.rkey, "address": self.address + address_shift,
                "cache_blocks": self.cache_blocks,
                "blocks": block_ids.numpy().astype("<u4").tobytes(),
                "slots_rkey": slots.rkey if slots is not None else b"",
                "slots_address": slots.address if slots is not None else 0,
                "slot": slot.slot if slot is not None else 0,
                "slot_tag": slot.tag if slot is not None else 0,
                "bell": slot.bell if slot is not None else 0}

    def release(self, slot: SlotLease | None) -> None:
        if slot is not None and self.slots is not None:
            self.slots.release(slot)


def share_slots(transport: HandoffTransport) -> SlotTable | None:
    """A slots region in shared memory (one per sender), if UCX and futexes allow it."""
    if not FUTEX_AVAILABLE:
        return None
    try:
        memory = transport.share_host_memory(REGION_BYTES)
    except UcpMemoryError as exc:
        log.warning("no shared slots region (%s): read pieces go out as PIECE frames", exc)
        return None
    region = transport.shared_region(memory)
    assert region is not None
    return SlotTable(memory, region.rkey)
