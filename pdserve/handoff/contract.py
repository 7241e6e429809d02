"""The handoff's contract, written once: what a KV receiver (decode side) and a KV sender
(prefill side) promise, and who owns which blocks when. `HandoffReceiver` and
`HandoffSender` implement it over UCXX; the workers construct those and call the methods
declared here (plus their `stats()`).

Block ownership during one transfer:

- decode: the engine reserves blocks and passes them to `KVReceiver.reserve`. From then until
  the ticket ends (ready, failed or cancelled) only the receiver writes into them, and only
  bytes of pieces whose headers passed its checks. When the ready future resolves (either
  way) or `cancel` returns, the receiver never writes into them again; the decode worker
  then joins them to its batch (ready) or frees them. The receiver never frees engine blocks.
- prefill: the engine keeps the request's blocks pinned from `KVSender.start_transfer` until
  the transfer's ``released`` future resolves. Only then may it free them or keep them in
  its prefix cache: no send reads them any more (all completed, or the peer failed and
  UCX cancelled them, or the deadline passed and they were given up).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from pdserve.engine.kv.layout import KVLayout
from pdserve.handoff.outbound import OutboundTransfer
from pdserve.handoff.ticket import FenceInfo, HandoffTicket


class KVReceiver(ABC):
    """Decode side. Thread-safe; every method returns without waiting on the network."""

    @abstractmethod
    def reserve(self, request_id: str, block_ids: Sequence[int], layout: KVLayout,
                num_tokens: int, deadline: float | None = None,
                kv_heads: tuple[int, int] | None = None) -> HandoffTicket:
        """Open a reservation of ``block_ids`` for ``request_id``'s KV and return the ticket
        a sender needs (it travels as ``to_dict()``). ``deadline``: absolute ``time.time()``
        after which the transfer fails with `HandoffTimeoutError`. ``kv_heads``: the part of
        the cache's KV heads this transfer fills (None: all), when ranks of a TP group send
        their heads apart; each is its own transfer, under its own ``request_id``. Raises
        ValueError for ids that are out of range, repeated or reserved (those heads) by
        another live transfer, and `LayoutMismatchError` for a layout other than the
        cache's."""

    @abstractmethod
    def ready_future(self, request_id: str) -> concurrent.futures.Future[FenceInfo]:
        """Resolves with the `FenceInfo` once every piece landed, its digest and the fence
        (counts, coverage, combined digest) verified; or raises the `HandoffError` that ended
        the transfer. Either way no write into the blocks follows."""

    async def wait_ready_async(self, request_id: str, timeout: float | None = None) -> FenceInfo:
        """Wait (asyncio, any event loop) until ready (see `ready_future`). The builtin
        TimeoutError means only this wait timed out: the transfer goes on."""
        future = asyncio.wrap_future(self.ready_future(request_id))
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise TimeoutError(f"request {request_id!r} not ready within {timeout}s") from None

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """End the transfer now (the sender is told). On return nothing writes into its blocks
        any more. Returns whether this call ended it (False: it had already ended)."""

    @abstractmethod
    def close(self) -> None:
        """Cancel every live transfer and stop receiving."""


class KVSender(ABC):
    """Prefill side. Thread-safe; the compute-thread methods never wait on the network."""

    @abstractmethod
    def start_transfer(self, ticket: HandoffTicket, block_ids: Sequence[int],
                       layout: KVLayout) -> OutboundTransfer:
        """Begin the handoff of ``block_ids`` (this worker's blocks, in the request's token
        order, as many as the ticket reserved) into the ticket's reservation: the ticket's KV
        heads of them, which ``layout`` (this cache's) must hold. A layout that cannot pair
        with the ticket's fails the transfer (both sides see a `HandoffLayoutError` naming what
        differs), it does not raise. The transfer's ``released`` future resolves with a
        `SendResult` once no send reads those blocks any more and the outcome is known
        (``SendResult.ok``: the receiver verified the fence)."""

    @abstractmethod
    def send_layer(self, cache: torch.Tensor, layer: int,
                   transfers: Sequence[OutboundTransfer]) -> None:
        """Compute thread, right after layer ``layer`` (local index) of ``cache`` was written:
        take that layer's blocks of every transfer in ``transfers`` (layers in order, once)."""

    @abstractmethod
    def send_fence(self, transfer: OutboundTransfer, first_token_id: int) -> None:
        """After every layer was sent: close the transfer with the first sampled token. A
        fence before every layer fails the transfer."""

    @abstractmethod
    def cancel(self, transfer: OutboundTransfer, reason: str = "cancelled") -> None:
        """Give the transfer up (the receiver is told); ``released`` still resolves only
        after its in-flight sends ended."""

    @abstractmethod
    def close(self) -> None:
        """Abort every transfer and drop every link."""

