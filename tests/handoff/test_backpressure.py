"""Staging bounds what is in flight, never what a transfer may move: between two real processes,
transfers ten times the staging on each side stream through it byte-exact, side by side."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tests.handoff.handoff_agent import Agent, running_agents
from tests.handoff.handoff_cases import pick_blocks, random_layout, reserve, setup_roles

pytestmark = pytest.mark.timeout(120)

STAGING = 256 << 10
SMALL_STAGING = {"receiver_staging_bytes": STAGING, "sender_staging_bytes": STAGING,
                 "max_piece_bytes": 64 << 10, "min_piece_bytes": 16 << 10}


@pytest.fixture(scope="module")
def small_pair() -> Iterator[tuple[Agent, Agent]]:
    with running_agents(SMALL_STAGING, SMALL_STAGING) as (receiver, sender):
        yield receiver, sender


def test_transfers_ten_times_the_staging_stream_through_it_exactly(small_pair) -> None:
    receiver, sender = small_pair
    rng = random.Random("backpressure")
    # 16 KiB per block and layer: 40 blocks x 4 layers = 2.5 MiB, 10x each side's staging.
    layout = random_layout(rng, "float32", block_size=16, num_kv_heads=4, head_dim=32,
                           num_layers=4)
    setup_roles(receiver, sender, layout, seed=9)
    dst = pick_blocks(rng, 46)
    src = pick_blocks(rng, 46)
    big = reserve(receiver, "big", dst[:40], layout)
    small = reserve(receiver, "small", dst[40:], layout)
    assert big["expected_bytes"] >= 10 * STAGING
    pushed = sender.call("push", tickets=[big, small], block_ids=[src[:40], src[40:]],
                         first_token_id=5)
    for request_id, dst_ids, src_ids, handle in (("big", dst[:40], src[:40], 0),
                                                  ("small", dst[40:], src[40:], 1)):
        ready = receiver.call("wait", request_id=request_id, timeout=60)
        assert ready["ok"], ready
        sent = sender.call("result", handle=pushed["handles"][handle], timeout=30)
        assert sent["ok"], sent
        assert receiver.call("read", block_ids=dst_ids) == sender.call("read", block_ids=src_ids)
    staging = sender.call("sender_stats")["staging"]
    assert staging["num_refused"] > 0  # the compute thread found staging full and went on
    assert staging["in_use_bytes"] == 0
    assert staging["in_use_bytes"] + staging["cached_bytes"] <= STAGING
    assert receiver.call("receiver_stats")["staging"]["in_use_bytes"] == 0
