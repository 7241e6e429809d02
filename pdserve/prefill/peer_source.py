"""The source side of a prefix pull: pin the cached blocks a puller asks for, send them with
a fence over this worker's handoff sender, and drop the pins once the send is released.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import RequestMode, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
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
    if transfer is None and await async_engine.call(
            lambda: engine.kv_manager.held_in_host_tier(ask.token_ids, ask.first_block)):
        transfer = await _send_from_host_tier(async_engine, sender, ask, ticket, unpin)
    if transfer is None:
        return "peer_miss"
    result = await asyncio.wrap_future(transfer.released)
    return None if result.ok else "peer_send"


async def _send_from_host_tier(async_engine: AsyncEngine, sender: HandoffSender,
                               ask: PeerSendRequest, ticket: HandoffTicket,
                               unpin: Callable[[str], None]) -> OutboundTransfer | None:
    """Part of the asked prefix sits in this worker's host tier: bring it back to device KV
    as any request's prefix would come (a prefill-only request of the prefix plus one token,
    which loads its blocks and computes that token alone), then pin and send them as cached
    blocks, releasing the request in the same engine-thread call so nothing evicts them in
    between. None when the request failed or the blocks still are not all cached."""
    engine = async_engine.engine
    bs = engine.layout.block_size
    prefix = list(ask.token_ids[:len(ask.token_ids) // bs * bs])
    rid = f"{ask.pull_id}/to-device"
    params = SamplingParams(max_tokens=1, temperature=0.0)
    stream = async_engine.open_stream(rid)
    try:
        await async_engine.call(lambda: engine.add_request(
            rid, [*prefix, prefix[-1]], params, RequestMode.PREFILL_ONLY))
        async for _ in async_engine.stream(rid, stream):
            pass
    except Exception as exc:  # noqa: BLE001 - the puller computes its prefix instead
        logger.warning("peer send %s: bringing the prefix back from the host tier failed: %r",
                       ask.pull_id, exc)
        await async_engine.call(lambda: engine.abort(rid))
        return None
    finally:
        await async_engine.close_stream(rid, abort=False)

    def pin_and_send() -> OutboundTransfer | None:
        request = engine.scheduler.get_request(rid)
        if request is not None and request.status is RequestStatus.PREFILLED:
            engine.release(rid)  # its full blocks stay cached for the pin below
        else:
            engine.abort(rid)
        return start_peer_send(engine, sender, ask, ticket, unpin)

    return await async_engine.call(pin_and_send)
