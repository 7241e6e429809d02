"""Which KV heads move between which ranks when a prefill TP group hands a request's KV to a
decode TP group of another size, and when the whole group's handoff is ready.

Each route is one transfer: one sender rank sends one head range of the request's blocks
into one receiver rank, which reserves it under its own request id (`route_request_id`). A
receiver rank's blocks are filled by every route into it, side by side by head; the decode
replica admits the request only when `all_ready` resolved, i.e. every route's fence verified.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from pdserve.engine.kv.layout import KVLayout, LayoutMismatchError, kv_head_range
from pdserve.handoff.ticket import HandoffTicket

_TP_FIELDS = ("tp_rank", "tp_size")


@dataclass(frozen=True)
class HeadRoute:
    """KV heads ``heads`` (the model's numbering) from sender rank ``sender_rank`` to receiver
    rank ``receiver_rank``."""

    sender_rank: int
    receiver_rank: int
    heads: tuple[int, int]


def route_heads(sender: KVLayout, receiver: KVLayout) -> list[HeadRoute]:
    """The routes between every rank of ``sender``'s TP group and of ``receiver``'s (any rank's
    layout stands for its group), ordered by receiver rank then head. Every receiver rank gets
    each of its heads exactly once; a head that several sender ranks hold (more sender ranks
    than KV heads) is sent by one of them, spread across them by receiver rank.

    Raises `LayoutMismatchError` naming what cannot pair: any field other than the TP rank and
    size differing, or TP sizes where neither divides the other."""
    diffs = [f"{f.name}: sender {getattr(sender, f.name)!r}, receiver {getattr(receiver, f.name)!r}"
             for f in fields(KVLayout)
             if f.name not in _TP_FIELDS and getattr(sender, f.name) != getattr(receiver, f.name)]
    small, large = sorted((sender.tp_size, receiver.tp_size))
    if large % small:
        diffs.append(f"sender TP {sender.tp_size} and receiver TP {receiver.tp_size}: neither "
                     f"divides the other, so their KV head ranges do not nest")
    if diffs:
        raise LayoutMismatchError("TP groups cannot be paired: " + "; ".join(diffs))
    num_heads = sender.num_kv_heads
    routes = []
    for receiver_rank in range(receiver.tp_size):
        start, end = kv_head_range(num_heads, receiver_rank, receiver.tp_size)
        head = start
        while head < end:
            holders = [rank for rank in range(sender.tp_size)
                       if _holds(kv_head_range(num_heads, rank, sender.tp_size), head)]
            rank = holders[receiver_rank % len(holders)]
            held_end = min(end, kv_head_range(num_heads, rank, sender.tp_size)[1])
            routes.append(HeadRoute(rank, receiver_rank, (head, held_end)))
            head = held_end
    return routes


def route_request_id(request_id: str, route: HeadRoute) -> str:
    """The id a receiver rank reserves one route under (unique per route of a request)."""
    return f"{request_id}/tp{route.sender_rank}>{route.receiver_rank}:{route.heads[0]}"


def group_ticket(tickets: Sequence[tuple[int, HandoffTicket]]) -> dict[str, Any]:
    """The ticket a decode replica of several routes hands out: each route's ticket with the
    sender rank that fills it. A single route travels as its plain ticket."""
    if len(tickets) == 1:
        return tickets[0][1].to_dict()
    return {"routes": [{"sender_rank": rank, "ticket": ticket.to_dict()}
                       for rank, ticket in tickets]}


def route_tickets(data: dict[str, Any]) -> list[tuple[int, HandoffTicket]]:
    """`group_ticket` read back: (sender rank, ticket) per route, a plain ticket as rank 0's.
    Raises ValueError or TypeError for anything else."""
    if "routes" not in data:
        return [(0, HandoffTicket.from_dict(data))]
    routes = data["routes"]
    if not isinstance(routes, list) or not routes:
        raise TypeError("a group ticket's routes must be a non-empty list")
    tickets = []
    for route in routes:
        if not isinstance(route, dict) or set(route) != {"sender_rank", "ticket"}:
            raise TypeError("each route of a group ticket is {sender_rank, ticket}")
        rank, ticket = route["sender_rank"], route["ticket"]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise TypeError(f"a route's sender_rank must be an int >= 0, got {rank!r}")
        if not isinstance(ticket, dict):
            raise TypeError("a route's ticket must be a dict (HandoffTicket.to_dict())")
        tickets.append((rank, HandoffTicket.from_dict(ticket)))
    if len({t.num_blocks for _, t in tickets}) != 1 or len({t.num_tokens for _, t in tickets}) != 1:
        raise ValueError("a group ticket's routes disagree on the blocks they cover")
    return tickets


def all_ready(futures: Sequence[concurrent.futures.Future],
              ) -> concurrent.futures.Future[list]:
    """One future over every route's ready future: their results in order once all verified,
    or the first failure as soon as any fails (the caller then cancels the other routes'
    reservations: a group's KV is usable only whole)."""
    combined: concurrent.futures.Future[list] = concurrent.futures.Future()
    lock, left = threading.Lock(), [len(futures)]

    def done(_: concurrent.futures.Future) -> None:
        with lock:
            if combined.done():
                return
            failed = next((f for f in futures if f.done() and (f.cancelled() or f.exception())),
                          None)
            if failed is not None:
                combined.set_exception(
                    concurrent.futures.CancelledError() if failed.cancelled()
                    else failed.exception())
                return
            left[0] -= 1
            if left[0] == 0:
                combined.set_result([f.result() for f in futures])

    if not futures:
        combined.set_result([])
    for future in futures:
        future.add_done_callback(done)
    return combined


def _holds(heads: tuple[int, int], head: int) -> bool:
    return heads[0] <= head < heads[1]
