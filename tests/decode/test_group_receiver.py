"""A decode replica's reception over two TP ranks (`GroupReceiver`): each route reserved in its
rank's receiver over the same blocks, one ticket naming both routes, and a route lost to a
dead rank fails the whole transfer with every reservation of the group cancelled.

Rank 1's receiver is a real `HandoffReceiver` of this process behind the async interface its
Ray actor offers (`ranks.RemoteReceiver`); both receivers share this process's one transport
(UCX allows one per process), so no frame is sent here: KV moving into both ranks is covered
over HTTP in tests/ranks/test_tp_handoff.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

from pdserve.decode.group_receiver import GroupReceiver
from pdserve.engine.kv.layout import KVLayout
from pdserve.handoff import (
    FenceInfo,
    HandoffConfig,
    HandoffError,
    HandoffReceiver,
    HandoffTransport,
)
from pdserve.handoff.routes import HeadRoute, route_tickets

LAYOUT = KVLayout("fp", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8,
                  tp_size=2)
NUM_BLOCKS = 16


class InProcessRank:
    """Rank 1's receiver as rank 0 reaches it; ``dead`` makes its waits fail as a dead
    actor's calls do."""

    def __init__(self, receiver: HandoffReceiver, layout: KVLayout) -> None:
        self.receiver, self.layout, self.dead = receiver, layout, False

    async def reserve(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                      deadline: float, kv_heads: tuple[int, int]) -> dict[str, Any]:
        return self.receiver.reserve(request_id, block_ids, self.layout, num_tokens, deadline,
                                     kv_heads).to_dict()

    async def wait_ready(self, request_id: str) -> FenceInfo:
        if self.dead:
            raise RuntimeError("The actor died unexpectedly before finishing this task.")
        return await self.receiver.wait_ready_async(request_id)

    async def cancel(self, request_id: str) -> bool:
        return self.receiver.cancel(request_id)


@pytest.fixture(scope="module")
def transport() -> Iterator[HandoffTransport]:
    config = HandoffConfig(auth_token="s3cret", timeout_s=30.0, net_devices=None,
                           ucx_transports="^cma", receiver_staging_bytes=1 << 20,
                           sender_staging_bytes=1 << 20, max_piece_bytes=1 << 20)
    transport = HandoffTransport(config).start()
    yield transport
    transport.stop()


@pytest.fixture
def ranks(transport: HandoffTransport) -> Iterator[tuple[HandoffReceiver, InProcessRank]]:
    layouts = [replace(LAYOUT, tp_rank=rank) for rank in range(2)]
    receivers = [HandoffReceiver(transport, torch.zeros(layout.cache_shape(NUM_BLOCKS)), layout)
                 for layout in layouts]
    try:
        yield receivers[0], InProcessRank(receivers[1], layouts[1])
    finally:
        for receiver in receivers:
            receiver.close()


def group_of(ranks: tuple[HandoffReceiver, InProcessRank]) -> GroupReceiver:
    local, remote = ranks
    return GroupReceiver(local, replace(LAYOUT, tp_rank=0), 1, lambda rank: remote, 30.0)


def test_each_rank_reserves_its_heads_of_the_same_blocks_under_one_ticket(ranks) -> None:
    group = group_of(ranks)
    assert group.routes == [HeadRoute(0, 0, (0, 1)), HeadRoute(0, 1, (1, 2))]
    ticket = asyncio.run(group.reserve("req", [3, 5, 7], 10))
    [(s0, t0), (s1, t1)] = route_tickets(ticket)
    assert (s0, s1) == (0, 0)  # one prefill rank sends both routes
    assert (t0.kv_heads, t1.kv_heads) == ((0, 1), (1, 2))
    assert (t0.layout.tp_rank, t1.layout.tp_rank) == (0, 1)
    local, remote = ranks
    assert local.writable_block_ids() == remote.receiver.writable_block_ids() == {3, 5, 7}
    asyncio.run(group.cancel("req"))
    assert local.writable_block_ids() == remote.receiver.writable_block_ids() == frozenset()


def test_a_route_lost_to_a_dead_rank_fails_the_group_and_cancels_every_route(ranks) -> None:
    group = group_of(ranks)
    local, remote = ranks
    asyncio.run(group.reserve("req", [1, 2], 8))
    remote.dead = True
    with pytest.raises(HandoffError, match="decode rank 1 failed while receiving"):
        asyncio.run(group.wait_ready("req"))
    # Nothing writes into the blocks any more: the engine may free them.
    assert local.writable_block_ids() == remote.receiver.writable_block_ids() == frozenset()
    # The blocks can be reserved again at once.
    asyncio.run(group.reserve("next", [1, 2], 8))
    asyncio.run(group.cancel("next"))


def test_a_reservation_failing_on_one_rank_releases_the_other(ranks) -> None:
    group = group_of(ranks)
    local, remote = ranks
    remote.receiver.reserve("other", [4], remote.layout, 4, kv_heads=(1, 2))  # rank 1 only
    with pytest.raises(ValueError, match=r"blocks \[4\] are reserved by another transfer"):
        asyncio.run(group.reserve("req", [4, 6], 8))
    assert local.writable_block_ids() == frozenset()
    assert remote.receiver.writable_block_ids() == {4}  # the other transfer's, untouched
