"""The source side of a prefix pull: pin the cached blocks a puller asks for, send them with
a fence over this worker's handoff sender, and drop the pins once the send is released.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.handoff import HandoffSender, HandoffTicket, OutboundTransfer
from pdserve.prefill.peer_kv import PeerSendRequest

logger = logging.getLogger(__name__)

# The fence of a pull carries no sampled token; the puller samples its own.
NO_TOKEN = 0


def start_peer_send(engine: LLMEngine, sender: HandoffSender, ask: PeerSendRequest,
                    ticket: HandoffTicket, unpin: Callable[[str], None]) -> OutboundTransfer | None:
    """Engine thread, on the source: pin the cached blocks and send every layer of them plus
    a fence; None (nothing pinned) when any block is not cached. The blocks stay pinned until
    the transfer's ``released`` resolved: ``unpin`` (engine thread work) is scheduled then."""
    pin_id = f"peer-send/{ticket.receiver_instance}/{ticket.transfer_id}"
    block_ids = engine.kv_manager.pin_cached(pin_id, ask.token_ids, ask.first_block)
    if block_ids is None:
        return None
    if len(block_ids) != ticket.num_blocks:
        engine.kv_manager.unpin(pin_id)
        return None
    transfer = sender.start_transfer(ticket, block_ids, engine.layout)
    for layer in range(engine.layout.num_local_layers):
        sender.send_layer(engine.kv_cache, layer, [transfer])
    sender.send_fence(transfer, NO_TOKEN)
    transfer.released.add_done_callback(lambda _: unpin(pin_id))
    return transfer


async def send_cached(async_engine: AsyncEngine, sender: HandoffSender,
                      ask: PeerSendRequest) -> str | None:
    """The source's side of a pull: None once every piece and the fence were sent, else why
    not (peer_miss: the blocks are no longer cached; bad_ticket; peer_send: the send
    failed)."""
    try:
        ticket = HandoffTicket.from_dict(ask.ticket)
    except (TypeError, ValueError) as exc:
        logger.warning("peer send %s refused: %s", ask.pull_id, exc)
        return "bad_ticket"
    engine = async_engine.engine

    def unpin(pin_id: str) -> None:
        async_engine.submit(lambda: engine.kv_manager.unpin(pin_id))

    transfer = await async_engine.call(
        lambda: start_peer_send(engine, sender, ask, ticket, unpin))
    if transfer is None:
        return "peer_miss"
    result = await asyncio.wrap_future(transfer.released)
    return None if result.ok else "peer_send"
