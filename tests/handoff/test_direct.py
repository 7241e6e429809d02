"""Direct pieces between two real OS processes: KV sent from the prefill cache's own rows and
received straight into the reserved decode blocks (no staging), with the same guarantees as
staged pieces: byte-exact, digest-checked, no write after a cancel, blocks back on faults.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import spawn_agents
from handoff_agent import Agent
from handoff_cases import (
    CACHE_BLOCKS,
    check_deferred_free,
    random_layout,
    reserve,
    setup_roles,
    wait_until,
)

from pdserve.engine.kv_layout import KVLayout

pytestmark = pytest.mark.timeout(120)
ALWAYS_DIRECT = 1  # direct_min_bytes: any run is worth a direct piece


def runs_of(rng: random.Random, lengths: list[int], exclude: set[int] | None = None) -> list[int]:
    """Block ids made of runs of consecutive ids with the given lengths, runs apart and in a
    random order (so run boundaries are real, and ids are not globally ascending)."""
    taken = set(exclude or ())
    runs: list[list[int]] = []
    for length in lengths:
        starts = [s for s in range(CACHE_BLOCKS - length + 1)
                  if not taken & set(range(s - 1, s + length + 1))]
        start = rng.choice(starts)
        runs.append(list(range(start, start + length)))
        taken.update(runs[-1])
    return [block for run in runs for block in run]


def push_direct(receiver: Agent, sender: Agent, request_id: str, dst: list[int],
                src: list[int], layout: KVLayout, first_token_id: int = 1) -> dict[str, Any]:
    """Reserve ``dst`` and push ``src`` into it, every run sent as direct pieces."""
    ticket = reserve(receiver, request_id, dst, layout)
    return sender.call("push", tickets=[ticket], block_ids=[src],
                       first_token_id=first_token_id, direct_min_bytes=ALWAYS_DIRECT)


def pieces_landed(receiver: Agent) -> tuple[int, int]:
    stats = receiver.call("receiver_stats")
    return stats["num_direct_pieces"], stats["num_staged_pieces"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_direct_round_trip_is_byte_exact_across_mismatched_runs(pair, dtype: str) -> None:
    receiver, sender = pair
    rng = random.Random(f"direct-{dtype}")
    layout = random_layout(rng, dtype)
    setup_roles(receiver, sender, layout, seed=rng.randrange(1000))
    # Decode runs 2+5+2, prefill runs 3+2+4: pieces split wherever either side's run breaks.
    dst, src = runs_of(rng, [2, 5, 2]), runs_of(rng, [3, 2, 4])
    before = pieces_landed(receiver)
    ticket = reserve(receiver, f"direct-{dtype}", dst, layout)
    assert ticket["block_runs"] == [2, 5, 2]
    pushed = sender.call("push", tickets=[ticket], block_ids=[src], first_token_id=9,
                         direct_min_bytes=ALWAYS_DIRECT)
    ready = receiver.call("wait", request_id=f"direct-{dtype}", timeout=20)
    assert ready["ok"] and ready["first_token_id"] == 9, ready
    assert sender.call("result", handle=pushed["handles"][0], timeout=20)["ok"]
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
    direct, staged = (a - b for a, b in zip(pieces_landed(receiver), before, strict=True))
    segments = 5  # cuts at 2, 3, 5, 7, 9
    assert (direct, staged) == (layout.num_local_layers * 2 * segments, 0)
    assert ready["num_pieces"] == direct
    assert receiver.call("receiver_stats")["writable_block_ids"] == []


def test_scattered_decode_blocks_fall_back_to_staged_pieces(pair) -> None:
    receiver, sender = pair
    rng = random.Random("direct-scattered")
    layout = random_layout(rng, "float16", num_layers=3)
    setup_roles(receiver, sender, layout, seed=5)
    dst = runs_of(rng, [1] * 6)
    src = runs_of(rng, [6])
    before = pieces_landed(receiver)
    ticket = reserve(receiver, "scattered", dst, layout)
    sender.call("push", tickets=[ticket], block_ids=[src], first_token_id=1)  # default policy
    assert receiver.call("wait", request_id="scattered", timeout=20)["ok"]
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
    direct, staged = (a - b for a, b in zip(pieces_landed(receiver), before, strict=True))
    assert direct == 0 and staged >= 1


def test_cancel_during_a_direct_transfer_stops_all_writes(pair) -> None:
    receiver, sender = pair
    rng = random.Random("direct-cancel")
    layout = random_layout(rng, "float16", num_layers=6)
    setup_roles(receiver, sender, layout, seed=19, receiver_faults={"recv_delay_s": 1.0})
    dst, src = runs_of(rng, [5]), runs_of(rng, [5])
    before = receiver.call("read", block_ids=dst)
    pushed = push_direct(receiver, sender, "direct-mid", dst, src, layout)
    wait_until(lambda: receiver.call("receiver_stats")["num_receiving"] == 1, 5, "begun")
    assert receiver.call("cancel", request_id="direct-mid")
    assert not set(dst) & set(receiver.call("receiver_stats")["writable_block_ids"])
    sent = sender.call("result", handle=pushed["handles"][0], timeout=20)
    assert sent["code"] == "cancelled", sent
    # Every piece was still held back by the delay: nothing reached the blocks, then or later.
    wait_until(lambda: receiver.call("receiver_stats")["num_drained"] >= 1, 10, "drained")
    assert receiver.call("read", block_ids=dst) == before


def test_direct_corruption_fails_with_a_digest_reason_and_spares_the_source(pair) -> None:
    receiver, sender = pair
    rng = random.Random("direct-corrupt")
    layout = random_layout(rng, "bfloat16", num_layers=4)
    setup_roles(receiver, sender, layout, seed=31, sender_faults={"corrupt_piece": 3})
    dst, src = runs_of(rng, [4]), runs_of(rng, [4])
    source = sender.call("read", block_ids=src)
    handle = push_direct(receiver, sender, "direct-corrupt", dst, src, layout)["handles"][0]
    outcome = receiver.call("wait", request_id="direct-corrupt", timeout=10)
    assert outcome["code"] == "digest" and "piece 3" in outcome["message"], outcome
    assert outcome["blocks_released"]
    assert sender.call("result", handle=handle, timeout=10)["code"] == "digest"
    assert sender.call("read", block_ids=src) == source  # the corruption hit a copy only


def test_deferred_free_holds_direct_source_rows_until_a_slow_receiver_took_them(pair) -> None:
    receiver, sender = pair
    rng = random.Random("direct-slow")
    layout = random_layout(rng, "float32", num_layers=2)
    delay = 1.0
    setup_roles(receiver, sender, layout, seed=13, receiver_faults={"recv_delay_s": delay})
    dst, src = runs_of(rng, [4]), runs_of(rng, [4])
    pushed = push_direct(receiver, sender, "direct-slow", dst, src, layout)
    check_deferred_free(receiver, sender, "direct-slow", pushed, delay, dst, src)


@pytest.fixture
def lone_receiver() -> Iterator[Agent]:
    """A receiver process of its own, for tests that kill a sender mid-message: that can stall
    the receiver's shared-memory transport for seconds (docs/handoff.md, "Limits"), which must
    not spill into the next test."""
    (agent,) = spawn_agents(None)
    yield agent
    agent.stop()


def test_sender_killed_mid_direct_stream_releases_the_reservation(lone_receiver) -> None:
    receiver = lone_receiver
    (doomed,) = spawn_agents(None)
    rng = random.Random("direct-kill")
    layout = random_layout(rng, "float32", num_layers=6, num_kv_heads=4, head_dim=64)
    setup_roles(receiver, doomed, layout, seed=23)
    dst, src = runs_of(rng, [8]), runs_of(rng, [8])
    deadline_s = 6.0
    reserved_at = receiver.call("now")
    ticket = reserve(receiver, "direct-orphan", dst, layout, timeout_s=deadline_s)
    handle = doomed.call("start", ticket=ticket, block_ids=src, direct_min_bytes=ALWAYS_DIRECT)
    doomed.call("send_layers", handles=[handle], layers=[0, 1, 2])  # half the layers, no fence
    wait_until(lambda: receiver.call("receiver_stats")["num_receiving"] == 1, 5, "begun")
    doomed.kill()
    outcome = receiver.call("wait", request_id="direct-orphan", timeout=deadline_s + 5)
    assert outcome["code"] in ("peer_gone", "timeout"), outcome
    assert outcome["ended_at"] <= reserved_at + deadline_s + 0.5
    # Receives the dead sender left half-done never complete over shared memory; they are
    # let go because its process is gone (not merely silent), so the blocks come back.
    assert outcome["blocks_released"]
    assert not set(dst) & set(receiver.call("receiver_stats")["writable_block_ids"])


def test_a_write_that_never_ends_quarantines_the_blocks_instead_of_releasing_them(pair) -> None:
    receiver, _ = pair
    rng = random.Random("direct-stall")
    layout = random_layout(rng, "float16", num_layers=2)
    receiver.call("make_cache", layout=layout.to_dict(), num_blocks=CACHE_BLOCKS, seed=3)
    receiver.call("make_receiver")
    dst = runs_of(rng, [3])
    reserve(receiver, "stalled", dst, layout)
    assert receiver.call("stall_direct_write", request_id="stalled")
    started = receiver.call("now")
    outcome = receiver.call("cancel", request_id="stalled")  # raises in the agent: reported
    assert outcome["code"] == "cancelled" and outcome["blocks_released"] is False, outcome
    assert receiver.call("now") - started >= 1.5  # waited peer_timeout_s for the write first
    # Still counted as writable: nobody may reuse them while UCX might write.
    assert set(dst) <= set(receiver.call("receiver_stats")["writable_block_ids"])
    assert receiver.call("wait", request_id="stalled", timeout=1)["blocks_released"] is False
    assert receiver.call("end_stalled_write", request_id="stalled")
    assert not set(dst) & set(receiver.call("receiver_stats")["writable_block_ids"])


def test_a_stalled_write_of_a_dead_local_sender_is_let_go(lone_receiver) -> None:
    receiver = lone_receiver
    (doomed,) = spawn_agents(None)
    rng = random.Random("direct-dead-stall")
    layout = random_layout(rng, "float16", num_layers=2)
    setup_roles(receiver, doomed, layout, seed=7)
    dst, src = runs_of(rng, [3]), runs_of(rng, [3])
    ticket = reserve(receiver, "dead-stall", dst, layout, timeout_s=8)
    doomed.call("start", ticket=ticket, block_ids=src, direct_min_bytes=ALWAYS_DIRECT)
    wait_until(lambda: receiver.call("receiver_stats")["num_receiving"] == 1, 5, "begun")
    assert receiver.call("stall_direct_write", request_id="dead-stall")  # a half-done receive
    doomed.kill()  # and its sender is gone for good: nothing can feed that receive again
    outcome = receiver.call("wait", request_id="dead-stall", timeout=15)
    assert outcome["code"] == "peer_gone" and outcome["blocks_released"], outcome
    assert not set(dst) & set(receiver.call("receiver_stats")["writable_block_ids"])
