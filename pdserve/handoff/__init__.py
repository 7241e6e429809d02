"""KV handoff: stream KV blocks from prefill to decode over UCXX.

Knows the engine's KV layout; nothing of Ray or HTTP.

Typical use (one `HandoffTransport` per process, started once):

    transport = HandoffTransport(HandoffConfig.from_env()).start()
    receiver = HandoffReceiver(transport, kv_cache, layout)      # decode worker
    ticket = receiver.reserve(request_id, block_ids, layout, num_tokens)
    ... ticket.to_dict() travels to a prefill worker ...
    kv_cache = ...view of transport.share_host_memory(nbytes)... # prefill worker, optional:
    sender = HandoffSender(transport)
    sender.export_cache(kv_cache)       # same-host receivers then read the blocks themselves
    transfer = sender.start_transfer(HandoffTicket.from_dict(d), src_block_ids, layout)
    sender.send_layer(kv_cache, layer, [transfer])               # per layer, compute thread
    sender.send_fence(transfer, first_token_id)
    transfer.released  # -> SendResult; free the source blocks only after it resolved
    await receiver.wait_ready_async(request_id)                  # -> FenceInfo, or HandoffError
    transport.stop()
"""

from pdserve.handoff.config import HandoffConfig
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
from pdserve.handoff.ucp_memory import UcpMemoryError

__all__ = [
    "FenceInfo",
    "HandoffAuthError",
    "HandoffCancelledError",
    "HandoffCapacityError",
    "HandoffConfig",
    "HandoffDigestError",
    "HandoffError",
    "HandoffLayoutError",
    "HandoffPeerGoneError",
    "HandoffProtocolError",
    "HandoffReceiver",
    "HandoffSender",
    "HandoffTicket",
    "HandoffTimeoutError",
    "HandoffTransport",
    "HandoffUnknownTransferError",
    "OutboundTransfer",
    "ReceiverStats",
    "SendResult",
    "SenderStats",
    "UcpMemoryError",
]
