"""KV handoff: stream KV blocks from prefill to decode over UCXX.

Knows the engine's KV layout; nothing of Ray or HTTP. The contract is `contract.py`.

Typical use (one `HandoffTransport` per process, started once):

    transport = HandoffTransport(HandoffConfig(auth_token=..., timeout_s=..., ...)).start()
    receiver = HandoffReceiver(transport, kv_cache, layout)      # decode worker
    ticket = receiver.reserve(request_id, block_ids, layout, num_tokens)
    ... ticket.to_dict() travels to a prefill worker ...
    sender = HandoffSender(transport, device=kv_cache.device)    # prefill worker
    transfer = sender.start_transfer(HandoffTicket.from_dict(d), src_block_ids, layout)
    sender.send_layer(kv_cache, layer, [transfer])               # per layer, compute thread
    sender.send_fence(transfer, first_token_id)
    transfer.released  # -> SendResult; free the source blocks only after it resolved
    await receiver.wait_ready_async(request_id)                  # -> FenceInfo, or HandoffError
    transport.stop()
"""

from pdserve.handoff.config import HandoffConfig
from pdserve.handoff.contract import KVReceiver, KVSender
from pdserve.handoff.errors import (
    HandoffAuthError,
    HandoffCancelledError,
    HandoffCapacityError,
    HandoffDigestError,
    HandoffError,
    HandoffLayoutError,
    HandoffPeerGoneError,
    HandoffProtocolError,
    HandoffTimeoutError,
    HandoffUnknownTransferError,
)
from pdserve.handoff.outbound import OutboundTransfer
from pdserve.handoff.receiver import HandoffReceiver, ReceiverStats
from pdserve.handoff.sender import HandoffSender, SenderStats
from pdserve.handoff.ticket import FenceInfo, HandoffTicket, SendResult
from pdserve.handoff.transport import HandoffTransport

__all__ = [
    "FenceInfo", "HandoffAuthError", "HandoffCancelledError", "HandoffCapacityError",
    "HandoffConfig", "HandoffDigestError", "HandoffError", "HandoffLayoutError",
    "HandoffPeerGoneError", "HandoffProtocolError", "HandoffReceiver", "HandoffSender",
    "HandoffTicket", "HandoffTimeoutError", "HandoffTransport", "HandoffUnknownTransferError",
    "KVReceiver", "KVSender", "OutboundTransfer", "ReceiverStats",
    "SendResult", "SenderStats",
]
