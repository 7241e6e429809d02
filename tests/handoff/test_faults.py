"""Handoff faults between real OS processes: a peer killed with SIGKILL mid-stream, corrupted
payloads, mismatched layouts, wrong tokens, lying headers. Every failure ends with a reason
and with the blocks released, never with corrupted KV marked ready.
"""

from __future__ import annotations

import random

import pytest

from tests.handoff.handoff_agent import spawn_agents
from tests.handoff.handoff_cases import (
    CACHE_BLOCKS,
    kill_sender_midstream,
    pick_blocks,
    push_one,
    random_layout,
    reserve,
    setup_roles,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


def test_sender_killed_midstream_fails_the_ticket_and_its_blocks_stay_clean(pair) -> None:
    """The dead sender's transfer fails fast (its process is gone: no waiting for silence),
    and the blocks, handed to the next transfer, receive that transfer's bytes only."""
    _, sender = pair
    # A receiver of its own: a sender killed while copying into UCX's shared-memory FIFO can
    # stall that receiver's transport for seconds (docs/handoff.md, limits).
    receiver, doomed = spawn_agents(None, None)
    try:
        killed_at = receiver.call("now")
        layout, dst, src = kill_sender_midstream(
            receiver, doomed, "kill-sender", deadline_s=6.0,
            in_flight=lambda d: receiver.call("receiver_stats")["num_receiving"] == 1)
        outcome = receiver.call("wait", request_id="kill-sender", timeout=1)
        assert outcome["code"] == "peer_gone", outcome
        assert outcome["ended_at"] - killed_at < 1.5  # before peer_timeout_s: known gone
        receiver.call("make_receiver")  # same cache, so dst still holds what landed
        sender.call("make_cache", layout=layout.to_dict(), num_blocks=CACHE_BLOCKS, seed=3)
        sender.call("make_sender")
        ticket = reserve(receiver, "after-kill", dst, layout)
        push_one(sender, ticket, src)
        assert receiver.call("wait", request_id="after-kill", timeout=20)["ok"]
        assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
    finally:
        receiver.stop()


def test_receiver_killed_midstream_completes_the_sender_with_an_error(pair) -> None:
    _, sender = pair
    (doomed,) = spawn_agents(None)
    rng = random.Random("kill-receiver")
    layout = random_layout(rng, "float32", num_layers=4, num_kv_heads=4, head_dim=64)
    # The receiver holds back its buffers, so every rendezvous send is in flight when it dies.
    setup_roles(doomed, sender, layout, seed=29, receiver_faults={"recv_delay_s": 60.0})
    dst, src = pick_blocks(rng, 8), pick_blocks(rng, 8)
    ticket = reserve(doomed, "abandoned", dst, layout, timeout_s=30)
    handle = push_one(sender, ticket, src)["handles"][0]
    wait_for(lambda: doomed.call("receiver_stats")["num_receiving"] == 1, 10, "transfer begun")
    wait_for(lambda: sender.call("sender_stats")["staging"]["in_use_bytes"] > 0, 5, "sends")
    killed_at = sender.call("now")
    doomed.kill()

    result = sender.call("result", handle=handle, timeout=15)
    assert not result["ok"] and result["code"] == "peer_gone", result
    assert result["released_at"] - killed_at < 5  # peer_timeout_s (1.5) plus heartbeat slack
    staging = sender.call("sender_stats")["staging"]
    assert staging["in_use_bytes"] == 0  # released (or retired: UCX may still hold them)
    assert result["released_at"] - killed_at < 1.0  # its process is gone: no silence TTL


def _push_faulty(receiver, sender, request_id: str, dtype: str, num_layers: int,
                 num_blocks: int, seed: int, faults: dict[str, int]) -> tuple[dict, int]:
    """One transfer, a piece per layer, from a sender with ``faults``: the receiver's
    outcome and the sender's handle."""
    rng = random.Random(request_id)
    layout = random_layout(rng, dtype, num_layers=num_layers)
    setup_roles(receiver, sender, layout, seed=seed, sender_faults=faults)
    dst, src = pick_blocks(rng, num_blocks), pick_blocks(rng, num_blocks)
    ticket = reserve(receiver, request_id, dst, layout)
    handle = push_one(sender, ticket, src, layers_per_piece=1)["handles"][0]
    return receiver.call("wait", request_id=request_id, timeout=10), handle


def test_corrupted_payload_fails_with_a_digest_reason(pair) -> None:
    receiver, sender = pair
    outcome, handle = _push_faulty(receiver, sender, "corrupt", "bfloat16", 4, 5, 31,
                                   {"corrupt_piece": 1})
    assert outcome["code"] == "digest" and "piece 1" in outcome["message"], outcome
    result = sender.call("result", handle=handle, timeout=10)
    assert result["code"] == "digest", result  # the sender learns the receiver's verdict


def test_mismatched_layout_is_refused_naming_the_field(pair) -> None:
    receiver, sender = pair
    rng = random.Random("layout")
    layout = random_layout(rng, "float16", num_layers=3, head_dim=16)
    wrong = random_layout(random.Random("layout"), "float16", num_layers=3, head_dim=8)
    setup_roles(receiver, sender, layout, seed=37, sender_layout=wrong)
    dst, src = pick_blocks(rng, 4), pick_blocks(rng, 4)
    before = receiver.call("read", block_ids=dst)
    ticket = reserve(receiver, "layout", dst, layout)
    handle = push_one(sender, ticket, src)["handles"][0]
    outcome = receiver.call("wait", request_id="layout", timeout=10)
    assert outcome["code"] == "layout" and "head_dim" in outcome["message"], outcome
    result = sender.call("result", handle=handle, timeout=10)
    assert result["code"] == "layout" and "head_dim" in result["message"], result
    assert receiver.call("read", block_ids=dst) == before


def test_wrong_token_is_refused_and_nothing_is_written(pair) -> None:
    receiver, _ = pair
    (intruder,) = spawn_agents({"auth_token": "not-the-cluster-secret"})
    try:
        rng = random.Random("token")
        layout = random_layout(rng, "float32", num_layers=2)
        setup_roles(receiver, intruder, layout, seed=41)
        dst, src = pick_blocks(rng, 3), pick_blocks(rng, 3)
        before = receiver.call("read", block_ids=dst)
        refused_before = receiver.call("receiver_stats")["num_refused_peers"]
        ticket = reserve(receiver, "intruder", dst, layout)
        handle = push_one(intruder, ticket, src)["handles"][0]
        result = intruder.call("result", handle=handle, timeout=10)
        assert result["code"] == "auth", result
        assert receiver.call("receiver_stats")["num_refused_peers"] == refused_before + 1
        assert receiver.call("read", block_ids=dst) == before
        assert receiver.call("cancel", request_id="intruder")  # never began: still ours
    finally:
        intruder.stop()


def test_header_claiming_more_bytes_than_reserved_is_refused_without_allocating(pair) -> None:
    receiver, sender = pair
    rng = random.Random("inflate")
    layout = random_layout(rng, "float32", num_layers=3)
    setup_roles(receiver, sender, layout, seed=43, sender_faults={"inflate_piece_bytes": 1 << 20})
    dst, src = pick_blocks(rng, 4), pick_blocks(rng, 4)
    baseline = receiver.call("receiver_stats")
    ticket = reserve(receiver, "liar", dst, layout)
    push_one(sender, ticket, src, layers_per_piece=1)
    outcome = receiver.call("wait", request_id="liar", timeout=10)
    assert outcome["code"] == "protocol" and "claims" in outcome["message"], outcome
    stats = receiver.call("receiver_stats")
    assert stats["staging"]["num_acquired"] == baseline["staging"]["num_acquired"]  # no buffer
    # All three announced pieces are consumed into a 1-byte sink, the lying one included.
    wait_for(lambda: receiver.call("receiver_stats")["num_drained"]
               >= baseline["num_drained"] + 3, 5, "drained pieces")


def test_payload_larger_than_its_header_is_refused(pair) -> None:
    receiver, sender = pair
    outcome, handle = _push_faulty(receiver, sender, "oversized", "float16", 3, 4, 45,
                                   {"pad_piece_bytes": 4096})
    assert outcome["code"] == "protocol" and "more than the" in outcome["message"], outcome
    assert sender.call("result", handle=handle, timeout=10)["code"] == "protocol"


def test_receiver_keeps_serving_after_faults(pair) -> None:
    """After the kills and refusals above, the same processes still move KV correctly."""
    receiver, sender = pair
    rng = random.Random("after")
    layout = random_layout(rng, "float16", num_layers=2)
    setup_roles(receiver, sender, layout, seed=47)
    dst, src = pick_blocks(rng, 3), pick_blocks(rng, 3)
    ticket = reserve(receiver, "after", dst, layout)
    push_one(sender, ticket, src, first_token_id=5)
    assert receiver.call("wait", request_id="after", timeout=10)["ok"]
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
