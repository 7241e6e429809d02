"""A prefill rank's own sends from step plan attachments: it starts only its routes, on the
first layer, sends every layer and fences after the last; its release resolves once its
transfers released (at once with none); a cancel before the start cancels them as they start.
The sender is a recorder: the bytes themselves move in tests/ranks over UCXX."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pdserve.engine.kv.layout import KVLayout, KVSlice
from pdserve.handoff.rank_sends import PLACEHOLDER_FIRST_TOKEN, RankSends, route_attachment
from pdserve.handoff.ticket import HandoffTicket, SendResult

LAYOUT = KVLayout("fp", "float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8,
                  tp_size=2)
RANK_1 = replace(LAYOUT, tp_rank=1)


@dataclass
class Transfer:
    ticket: HandoffTicket
    block_ids: list[int]
    released: concurrent.futures.Future[SendResult] = field(
        default_factory=concurrent.futures.Future)


@dataclass
class RecordingSender:
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)

    def start_transfer(self, ticket: HandoffTicket, block_ids: list[int],
                       layout: KVLayout) -> Transfer:
        assert layout == RANK_1
        self.transfers.append(Transfer(ticket, list(block_ids)))
        return self.transfers[-1]

    def send_layer(self, cache: torch.Tensor, layer: int, transfers: list[Transfer]) -> None:
        self.calls.append(("layer", layer, len(transfers)))

    def send_fence(self, transfer: Transfer, first_token_id: int) -> None:
        self.calls.append(("fence", first_token_id))

    def cancel(self, transfer: Transfer, reason: str) -> None:
        self.calls.append(("cancel", reason))
        release(transfer, error=RuntimeError(reason))


def release(transfer: Transfer, error: Exception | None = None) -> None:
    transfer.released.set_result(SendResult("r", 7, 0, 0, error, time.monotonic()))


def ticket(heads: tuple[int, int]) -> HandoffTicket:
    decode = replace(LAYOUT, tp_size=1)  # the receiver's layout: one rank holds both heads
    kv = KVSlice(decode, heads)
    return HandoffTicket("r", 7, b"ucx-address", 9, "host", 2, 5,
                         kv.num_local_layers * 2 * kv.block_bytes, 4096, 1e12, decode, heads)


def sends() -> tuple[RankSends, RecordingSender]:
    sender = RecordingSender()
    return RankSends(sender, torch.zeros(1), RANK_1, 3), sender  # type: ignore[arg-type]


ROUTES = [(0, ticket((0, 1))), (1, ticket((1, 2)))]


def test_a_rank_sends_only_its_routes_each_layer_then_fences_them() -> None:
    rank, sender = sends()
    step = {"req": route_attachment(ROUTES, [4, 5])}
    for layer in range(3):
        rank.on_layer(layer, step)
    [transfer] = sender.transfers
    assert transfer.ticket == ROUTES[1][1] and transfer.block_ids == [4, 5]
    assert sender.calls == [("layer", 0, 1), ("layer", 1, 1), ("layer", 2, 1),
                            ("fence", PLACEHOLDER_FIRST_TOKEN)]
    released = rank.released("req")
    assert not released.done()
    release(transfer)
    assert [r.ok for r in released.result(timeout=5)] == [True]
    rank.on_layer(0, {})  # a later step without attachments sends nothing
    assert len(sender.calls) == 4


def test_a_rank_without_routes_of_a_request_is_released_at_once() -> None:
    rank, sender = sends()
    rank.on_layer(0, {"req": route_attachment(ROUTES[:1], [4, 5])})
    assert sender.transfers == [] and rank.released("req").result(timeout=5) == []


def test_a_cancel_before_the_rank_started_cancels_the_transfers_as_they_start() -> None:
    rank, sender = sends()
    rank.cancel("req", "the prefill request was cancelled")
    rank.on_layer(0, {"req": route_attachment(ROUTES, [4, 5])})
    assert ("cancel", "the prefill request was cancelled") in sender.calls
    [result] = rank.released("req").result(timeout=5)
    assert not result.ok
    rank.forget("req")
