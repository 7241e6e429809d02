"""The KV sends of a prefill rank other than 0: rank 0 attaches each finishing request's routes
and source blocks to the step plan; the rank sends the routes it is the sender of, per layer.

The fence of such a route carries a placeholder first token: decode takes the first token from
a route of prefill rank 0 (`decode.group_receiver`), which alone samples.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pdserve.engine.kv.layout import KVLayout
from pdserve.handoff.outbound import OutboundTransfer
from pdserve.handoff.routes import all_ready, route_tickets
from pdserve.handoff.sender import HandoffSender
from pdserve.handoff.ticket import HandoffTicket, SendResult

logger = logging.getLogger(__name__)

PLACEHOLDER_FIRST_TOKEN = 0  # never read: decode takes rank 0's


def route_attachment(tickets: Sequence[tuple[int, HandoffTicket]],
                     block_ids: Sequence[int]) -> dict[str, Any]:
    """What the other ranks need of one request (msgpack-plain): the routes they send, as
    `group_ticket` writes them, and the source blocks (the same ids on every rank)."""
    return {"routes": [{"sender_rank": rank, "ticket": ticket.to_dict()}
                       for rank, ticket in tickets if rank != 0],
            "block_ids": [int(b) for b in block_ids]}


class RankSends:
    """One rank's transfers. `on_layer` runs on the rank's step thread; `released` and
    `cancel` on its actor's loop (rank 0 asks through Ray)."""

    def __init__(self, sender: HandoffSender, kv_cache: torch.Tensor, layout: KVLayout,
                 num_layers: int) -> None:
        self.sender, self.kv_cache, self.layout = sender, kv_cache, layout
        self.last_layer = num_layers - 1
        self._lock = threading.Lock()
        self._step: list[OutboundTransfer] = []  # step thread only: this step's transfers
        self._transfers: dict[str, list[OutboundTransfer]] = {}
        self._released: dict[str, concurrent.futures.Future[list[SendResult]]] = {}
        self._cancelled: set[str] = set()  # cancelled before this rank started them

    def on_layer(self, layer: int, attachments: Mapping[str, Any]) -> None:
        """Right after ``layer`` wrote its KV: start this step's transfers (first layer), send
        the layer, and after the last one fence them."""
        if layer == 0:
            self._step = [t for rid, data in attachments.items() for t in self._start(rid, data)]
        if not self._step:
            return
        self.sender.send_layer(self.kv_cache, layer, self._step)
        if layer == self.last_layer:
            for transfer in self._step:
                self.sender.send_fence(transfer, PLACEHOLDER_FIRST_TOKEN)
            self._step = []

    def released(self, request_id: str) -> concurrent.futures.Future[list[SendResult]]:
        """Resolves once no send of this rank for ``request_id`` reads its blocks any more."""
        with self._lock:
            return self._released.setdefault(request_id, concurrent.futures.Future())

    def forget(self, request_id: str) -> None:
        """Rank 0 freed the request's blocks: drop what is kept of it."""
        with self._lock:
            self._released.pop(request_id, None)
            self._cancelled.discard(request_id)

    def cancel(self, request_id: str, reason: str) -> None:
        """Stop the request's sends (its transfers not started yet: as soon as they start)."""
        with self._lock:
            transfers = self._transfers.get(request_id)
            if transfers is None:
                self._cancelled.add(request_id)
                return
        for transfer in transfers:
            self.sender.cancel(transfer, reason)

    def _start(self, request_id: str, data: Any) -> list[OutboundTransfer]:
        rank = self.layout.tp_rank
        own = [t for r, t in route_tickets({"routes": data["routes"]}) if r == rank] \
            if data["routes"] else []
        transfers = [self.sender.start_transfer(ticket, data["block_ids"], self.layout)
                     for ticket in own]
        with self._lock:
            self._transfers[request_id] = transfers
            cancelled = request_id in self._cancelled
            future = self._released.setdefault(request_id, concurrent.futures.Future())
        if cancelled:
            for transfer in transfers:
                self.sender.cancel(transfer, "the prefill request was cancelled")
        combined = all_ready([t.released for t in transfers])
        combined.add_done_callback(lambda done: self._done(request_id, future, done))
        return transfers

    def _done(self, request_id: str, future: concurrent.futures.Future[list[SendResult]],
              done: concurrent.futures.Future[list[SendResult]]) -> None:
        with self._lock:
            self._transfers.pop(request_id, None)
        if not future.done():
            future.set_result(done.result())
