"""Routes of KV heads between TP groups of different sizes, and a group's readiness."""

from __future__ import annotations

import concurrent.futures
from dataclasses import replace

import pytest

from pdserve.engine.kv.layout import KVLayout, KVSlice, LayoutMismatchError
from pdserve.handoff.errors import HandoffCancelledError
from pdserve.handoff.routes import (
    HeadRoute,
    all_ready,
    group_ticket,
    route_heads,
    route_request_id,
    route_tickets,
)
from pdserve.handoff.ticket import HandoffTicket

LAYOUT = KVLayout("fp", "bfloat16", block_size=4, num_layers=2, num_kv_heads=8, head_dim=8)


def tp(size: int, **changes: object) -> KVLayout:
    return replace(LAYOUT, tp_size=size, **changes)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("sender_tp, receiver_tp", [(a, b) for a in (1, 2, 4, 8)
                                                    for b in (1, 2, 4, 8)])
def test_every_receiver_rank_gets_each_of_its_heads_once_from_a_rank_holding_it(
        sender_tp: int, receiver_tp: int, num_kv_heads: int) -> None:
    sender, receiver = tp(sender_tp, num_kv_heads=num_kv_heads), tp(receiver_tp,
                                                                     num_kv_heads=num_kv_heads)
    routes = route_heads(sender, receiver)
    for rank in range(receiver_tp):
        mine = [r for r in routes if r.receiver_rank == rank]
        wanted = replace(receiver, tp_rank=rank).kv_heads
        assert mine[0].heads[0] == wanted[0] and mine[-1].heads[1] == wanted[1]
        # no gap, no overlap
        assert all(a.heads[1] == b.heads[0] for a, b in zip(mine, mine[1:], strict=False))
        for route in mine:
            held = replace(sender, tp_rank=route.sender_rank).kv_heads
            assert held[0] <= route.heads[0] < route.heads[1] <= held[1]
    assert len({route_request_id("r", r) for r in routes}) == len(routes)


def test_merge_and_split_routes_by_example() -> None:
    assert route_heads(tp(2), tp(1)) == [HeadRoute(0, 0, (0, 4)), HeadRoute(1, 0, (4, 8))]
    assert route_heads(tp(1), tp(2)) == [HeadRoute(0, 0, (0, 4)), HeadRoute(0, 1, (4, 8))]
    assert route_heads(tp(4), tp(2)) == [HeadRoute(0, 0, (0, 2)), HeadRoute(1, 0, (2, 4)),
                                         HeadRoute(2, 1, (4, 6)), HeadRoute(3, 1, (6, 8))]
    # one KV head on both ranks of TP 2: decode TP 2's ranks each take it from their own
    one = {"num_kv_heads": 1}
    assert route_heads(tp(2, **one), tp(2, **one)) == [HeadRoute(0, 0, (0, 1)),
                                                       HeadRoute(1, 1, (0, 1))]


@pytest.mark.parametrize("sender, receiver, reason", [
    (tp(3, num_kv_heads=6), tp(2, num_kv_heads=6), "sender TP 3 and receiver TP 2: neither"),
    (tp(2), tp(2, head_dim=16), "head_dim: sender 8, receiver 16"),
    (tp(1), tp(2, dtype="float16"), "dtype: sender 'bfloat16', receiver 'float16'"),
])
def test_groups_that_cannot_pair_are_refused_naming_why(sender: KVLayout, receiver: KVLayout,
                                                        reason: str) -> None:
    with pytest.raises(LayoutMismatchError, match=reason):
        route_heads(sender, receiver)


def test_a_group_is_ready_only_when_every_route_is_and_fails_with_the_first_failure() -> None:
    futures = [concurrent.futures.Future() for _ in range(3)]
    group = all_ready(futures)
    futures[0].set_result("a")
    futures[2].set_result("c")
    assert not group.done()
    futures[1].set_result("b")
    assert group.result(0) == ["a", "b", "c"]

    futures = [concurrent.futures.Future() for _ in range(2)]
    group = all_ready(futures)
    futures[1].set_exception(HandoffCancelledError("rank 1 gone"))
    with pytest.raises(HandoffCancelledError, match="rank 1 gone"):
        group.result(0)
    futures[0].set_result("late")  # later outcomes change nothing
    assert isinstance(group.exception(0), HandoffCancelledError)
    assert all_ready([]).result(0) == []


def _ticket(layout: KVLayout, heads: tuple[int, int], num_blocks: int = 2) -> HandoffTicket:
    kv = KVSlice(layout, heads)
    return HandoffTicket("r", 7, b"ucx-address", 9, "host", num_blocks, 5,
                         kv.num_local_layers * num_blocks * kv.block_bytes, 4096, 1e12, layout,
                         heads)


def test_a_group_ticket_names_each_route_and_reads_back() -> None:
    one = _ticket(tp(1), (0, 8))
    assert group_ticket([(0, one)]) == one.to_dict()  # one route travels plain
    assert route_tickets(one.to_dict()) == [(0, one)]
    routes = [(0, _ticket(tp(2), (0, 4))), (0, _ticket(tp(2, tp_rank=1), (4, 8)))]
    data = group_ticket(routes)
    assert [r["sender_rank"] for r in data["routes"]] == [0, 0]
    assert route_tickets(data) == routes


@pytest.mark.parametrize("data, reason", [
    ({"routes": []}, "non-empty list"),
    ({"routes": [{"ticket": {}}]}, "sender_rank, ticket"),
    ({"routes": [{"sender_rank": -1, "ticket": {}}]}, "sender_rank must be an int >= 0"),
    ({"routes": [{"sender_rank": 0, "ticket": "t"}]}, "must be a dict"),
])
def test_group_tickets_of_the_wrong_shape_are_refused(data: dict, reason: str) -> None:
    with pytest.raises(TypeError, match=reason):
        route_tickets(data)


def test_routes_that_disagree_on_their_blocks_are_refused() -> None:
    data = group_ticket([(0, _ticket(tp(2), (0, 4))), (0, _ticket(tp(2, tp_rank=1), (4, 8), 3))])
    with pytest.raises(ValueError, match="disagree on the blocks"):
        route_tickets(data)
