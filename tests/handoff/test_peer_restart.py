"""Peer restarts between real processes: a restarted receiver or sender is a new handoff
identity (new UCX address, new instance); the other side fails its stale link and the
transfers pending on it as soon as the old process is known gone (its pid, on this machine;
its endpoint's UCX error, across machines), well before the silence timeout, and serves the
new process over a fresh link.
"""

from __future__ import annotations

import random

import pytest

from tests.handoff.handoff_agent import TEST_CONFIG, Agent, spawn_agents
from tests.handoff.handoff_cases import pick_blocks, push_one, random_layout, reserve, setup_roles
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)
PEER_TIMEOUT_S = TEST_CONFIG["peer_timeout_s"]  # 1.5 s: "fast" means well under it
# Agents that claim different machines: endpoints with UCX error handling (TCP here), no pid
# checks; what a cluster of several hosts runs.
REMOTE = [{"host_id": "machine-a"}, {"host_id": "machine-b"}]


def half_a_transfer(receiver: Agent, sender: Agent, request_id: str) -> tuple[int, float]:
    """A transfer whose sender sent half its layers and no fence: in flight. Returns the
    sender's handle and the receiver's clock when it was under way."""
    rng = random.Random(request_id)
    layout = random_layout(rng, "float32", num_layers=6, num_kv_heads=4, head_dim=64)
    setup_roles(receiver, sender, layout, seed=3, receiver_faults={"recv_delay_s": 30.0})
    ticket = reserve(receiver, request_id, pick_blocks(rng, 6), layout, timeout_s=20)
    handle = sender.call("start", ticket=ticket, block_ids=pick_blocks(rng, 6),
                         layers_per_piece=1)
    sender.call("send_layers", handles=[handle], layers=[0, 1, 2])
    wait_for(lambda: receiver.call("receiver_stats")["num_receiving"] == 1, 10, "begun")
    return handle, receiver.call("now")


def round_trip(receiver: Agent, sender: Agent, request_id: str) -> None:
    rng = random.Random(request_id)
    layout = random_layout(rng, "float16", num_layers=2)
    setup_roles(receiver, sender, layout, seed=5)
    dst, src = pick_blocks(rng, 3), pick_blocks(rng, 3)
    ticket = reserve(receiver, request_id, dst, layout)
    push_one(sender, ticket, src, first_token_id=2)
    assert receiver.call("wait", request_id=request_id, timeout=20)["ok"]
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)


@pytest.mark.parametrize("where", ["same machine", "other machines"])
def test_a_restarted_receiver_fails_the_stale_link_fast_and_gets_a_fresh_one(where: str) -> None:
    configs = REMOTE if where == "other machines" else [None, None]
    sender, receiver = spawn_agents(*configs)
    replacement = None
    try:
        round_trip(receiver, sender, "before-restart")  # a pooled link to the old receiver
        handle, _ = half_a_transfer(receiver, sender, "pending")
        killed_at = sender.call("now")
        receiver.kill()
        result = sender.call("result", handle=handle, timeout=15)
        assert not result["ok"] and result["code"] == "peer_gone", result
        assert result["released_at"] - killed_at < PEER_TIMEOUT_S * 0.8, result  # not a TTL
        wait_for(lambda: sender.call("sender_stats")["num_links"] == 0, 5, "stale link gone")
        (replacement,) = spawn_agents(configs[1])
        assert replacement.address != receiver.address
        round_trip(replacement, sender, "after-restart")
        assert sender.call("sender_stats")["num_links"] == 1  # the fresh one
    finally:
        for agent in (sender, replacement):
            if agent is not None:
                agent.stop()


@pytest.mark.parametrize("where", ["same machine", "other machines"])
def test_a_restarted_sender_fails_its_pending_transfers_fast_and_the_new_one_is_served(
        where: str) -> None:
    configs = REMOTE if where == "other machines" else [None, None]
    receiver, sender = spawn_agents(*configs)
    replacement = None
    try:
        _, began_at = half_a_transfer(receiver, sender, "orphan")
        killed_at = receiver.call("now")
        sender.kill()
        outcome = receiver.call("wait", request_id="orphan", timeout=15)
        assert outcome["code"] == "peer_gone", outcome
        assert outcome["ended_at"] - killed_at < PEER_TIMEOUT_S * 0.8, (outcome, began_at)
        assert receiver.call("receiver_stats")["writable_block_ids"] == []
        (replacement,) = spawn_agents(configs[1])
        round_trip(receiver, replacement, "after-restart")
    finally:
        for agent in (receiver, replacement):
            if agent is not None:
                agent.stop()
