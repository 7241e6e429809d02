"""KV handoff between TP groups of different sizes, each rank a real OS process over UCXX
loopback: prefill ranks send the KV heads they hold to the decode ranks that own them
(`routes.route_heads`), merging head ranges into one decode cache or splitting one prefill
cache's heads across decode ranks; the group is ready only when every route verified.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pdserve.engine.kv.layout import KVLayout
from pdserve.handoff.routes import HeadRoute, route_heads, route_request_id
from tests.handoff.handoff_agent import Agent, running_agents
from tests.handoff.handoff_cases import CACHE_BLOCKS, pick_blocks, random_layout

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def trio() -> Iterator[list[Agent]]:
    """Three rank processes, re-cast as prefill or decode ranks by each test."""
    with running_agents(None, None, None) as agents:
        yield agents
    assert all(agent.process.exitcode == 0 for agent in agents)


def make_groups(agents: list[Agent], whole: KVLayout, sender_tp: int, receiver_tp: int,
                ) -> tuple[list[Agent], list[Agent]]:
    """The first ``sender_tp`` agents as prefill ranks, the next ``receiver_tp`` as decode
    ranks, each with a fresh random cache of its rank's heads."""
    senders, receivers = agents[:sender_tp], agents[sender_tp:sender_tp + receiver_tp]
    for ranks, size, role in ((receivers, receiver_tp, "make_receiver"),
                              (senders, sender_tp, "make_sender")):
        for rank, agent in enumerate(ranks):
            agent.call("make_cache", layout=replace(whole, tp_rank=rank, tp_size=size).to_dict(),
                       num_blocks=CACHE_BLOCKS, seed=31 * rank + size + len(role))
            agent.call(role)
    return senders, receivers


def local(heads: tuple[int, int], layout: KVLayout) -> list[int]:
    """``heads`` among ``layout``'s own."""
    start = layout.kv_heads[0]
    return [heads[0] - start, heads[1] - start]


def reserve_routes(receivers: list[Agent], routes: list[HeadRoute], request_id: str,
                   dst: list[int], num_tokens: int) -> list[dict]:
    return [receivers[r.receiver_rank].call(
        "reserve", request_id=route_request_id(request_id, r), block_ids=dst,
        num_tokens=num_tokens, kv_heads=list(r.heads)) for r in routes]


@pytest.mark.parametrize("sender_tp, receiver_tp, num_kv_heads", [
    (2, 1, 4),  # merge: each prefill rank's half into one decode cache
    (1, 2, 4),  # split: one prefill cache's heads to two decode ranks
    (2, 1, 1),  # one KV head on both prefill ranks: one of them sends it
    (1, 2, 1),  # one KV head replicated on both decode ranks: sent to each
])
def test_heads_move_between_tp_groups_and_land_byte_exact(trio, sender_tp: int, receiver_tp: int,
                                                          num_kv_heads: int) -> None:
    rng = random.Random(f"tp-{sender_tp}-{receiver_tp}-{num_kv_heads}")
    whole = random_layout(rng, "bfloat16", num_kv_heads=num_kv_heads, num_layers=3)
    senders, receivers = make_groups(trio, whole, sender_tp, receiver_tp)
    sender_layouts = [replace(whole, tp_rank=r, tp_size=sender_tp) for r in range(sender_tp)]
    receiver_layouts = [replace(whole, tp_rank=r, tp_size=receiver_tp) for r in range(receiver_tp)]
    routes = route_heads(sender_layouts[0], receiver_layouts[0])
    # A TP group shares one block table: the same block ids on every rank of a side.
    dst, src = pick_blocks(rng, 5), pick_blocks(rng, 5)
    request_id = f"tp{sender_tp}>{receiver_tp}/{num_kv_heads}"
    tickets = reserve_routes(receivers, routes, request_id, dst, 5 * whole.block_size - 2)
    for rank, sender in enumerate(senders):
        mine = [t for t, r in zip(tickets, routes, strict=True) if r.sender_rank == rank]
        pushed = sender.call("push", tickets=mine, block_ids=[src] * len(mine), first_token_id=9)
        for handle in pushed["handles"]:
            assert sender.call("result", handle=handle, timeout=20)["ok"]
    for rank, receiver in enumerate(receivers):
        ids = [route_request_id(request_id, r) for r in routes if r.receiver_rank == rank]
        ready = receiver.call("wait_all", request_ids=ids, timeout=20)
        assert ready["ok"], ready
        assert ready["num_bytes"] == (whole.num_layers * 5
                                      * receiver_layouts[rank].block_bytes)  # all its heads
        assert receiver.call("receiver_stats")["writable_block_ids"] == []
    for route in routes:
        landed = receivers[route.receiver_rank].call(
            "read", block_ids=dst, local_heads=local(route.heads,
                                                     receiver_layouts[route.receiver_rank]))
        sent = senders[route.sender_rank].call(
            "read", block_ids=src, local_heads=local(route.heads,
                                                     sender_layouts[route.sender_rank]))
        assert landed == sent, route


def test_one_rank_failing_fails_the_group_and_releases_every_reservation(trio) -> None:
    """Prefill TP 2 -> decode TP 1: rank 0's heads arrive and verify, rank 1 cancels its
    transfer. The group's readiness fails with rank 1's error; nothing is left writable."""
    rng = random.Random("tp-fail")
    whole = random_layout(rng, "float32", num_kv_heads=4, num_layers=3)
    senders, (receiver,) = make_groups(trio, whole, 2, 1)
    routes = route_heads(replace(whole, tp_size=2), whole)
    dst, src = pick_blocks(rng, 4), pick_blocks(rng, 4)
    tickets = reserve_routes([receiver], routes, "fail", dst, 4 * whole.block_size)
    ok = senders[0].call("push", tickets=[tickets[0]], block_ids=[src], first_token_id=1)
    assert senders[0].call("result", handle=ok["handles"][0], timeout=20)["ok"]
    handle = senders[1].call("start", ticket=tickets[1], block_ids=src, layers_per_piece=1)
    senders[1].call("send_layers", handles=[handle], layers=[0])
    senders[1].call("cancel_push", handle=handle)
    ids = [route_request_id("fail", r) for r in routes]
    outcome = receiver.call("wait_all", request_ids=ids, timeout=20)
    assert not outcome["ok"] and outcome["code"] == "cancelled", outcome
    assert receiver.call("cancel", request_id=ids[0]) is False  # already verified: nothing held
    assert receiver.call("receiver_stats")["writable_block_ids"] == []


def test_a_rank_sending_heads_it_does_not_hold_is_refused_on_both_sides(trio) -> None:
    """Prefill TP 2 -> decode TP 1 where rank 0 is handed rank 1's ticket: the sender fails the
    transfer, the receiver refuses it, both name the heads; no byte is written."""
    rng = random.Random("tp-wrong-rank")
    whole = random_layout(rng, "float16", num_kv_heads=4, num_layers=2)
    senders, (receiver,) = make_groups(trio, whole, 2, 1)
    dst, src = pick_blocks(rng, 3), pick_blocks(rng, 3)
    before = receiver.call("read", block_ids=dst)
    ticket = receiver.call("reserve", request_id="wrong", block_ids=dst, num_tokens=3,
                           kv_heads=[2, 4])
    handle = senders[0].call("push", tickets=[ticket], block_ids=[src],
                             first_token_id=1)["handles"][0]
    outcome = receiver.call("wait", request_id="wrong", timeout=10)
    assert outcome["code"] == "layout" and "KV heads [2, 4)" in outcome["message"], outcome
    result = senders[0].call("result", handle=handle, timeout=10)
    assert result["code"] == "layout" and "TP rank 0 of 2" in result["message"], result
    assert receiver.call("read", block_ids=dst) == before
    assert receiver.call("receiver_stats")["writable_block_ids"] == []
