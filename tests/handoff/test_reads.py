"""Same-host reads between two real OS processes: the prefill cache lives in UCX shared memory,
the decode side maps it (rkey) and copies each announced piece into its reserved blocks
itself. Pieces and fence are announced in a shared read slot (futex bell), or by frames when
no slot is free. Same guarantees as pushed pieces: byte-exact, digest-checked, nothing written
after a cancel, the sender's blocks held until the reads are over, blocks back when a sender
dies.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import spawn_agents
from handoff_agent import Agent
from handoff_cases import (
    CACHE_BLOCKS,
    check_deferred_free,
    kill_sender_midstream,
    pick_blocks,
    random_layout,
    reserve,
    setup_roles,
    wait_until,
)

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff.read_slots import NUM_SLOTS, REGION_BYTES

pytestmark = pytest.mark.timeout(120)


def piece_counts(receiver: Agent) -> dict[str, int]:
    stats = receiver.call("receiver_stats")
    return {k: stats[f"num_{k}_pieces"] for k in ("read", "direct", "staged")}


def landed_since(receiver: Agent, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in piece_counts(receiver).items()}


def wait_slots_returned(sender: Agent) -> None:
    """Released transfers give their read slot back to the sender's table."""
    wait_until(lambda: sender.call("sender_stats")["num_free_read_slots"] == NUM_SLOTS, 5,
               "every read slot to come back")


def consecutive(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def hand_off(receiver: Agent, sender: Agent, request_id: str, dst: list[int], src: list[int],
             layout: KVLayout, **push: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reserve ``dst``, hand ``src`` over; returns (receiver outcome, sender outcome)."""
    ticket = reserve(receiver, request_id, dst, layout)
    pushed = sender.call("push", tickets=[ticket], block_ids=[src], first_token_id=3, **push)
    ready = receiver.call("wait", request_id=request_id, timeout=20)
    return ready, sender.call("result", handle=pushed["handles"][0], timeout=20)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", ["scattered", "runs"])
def test_reads_are_byte_exact(pair, dtype: str, shape: str) -> None:
    receiver, sender = pair
    rng = random.Random(f"reads-{dtype}-{shape}")
    layout = random_layout(rng, dtype)
    assert setup_roles(receiver, sender, layout, seed=rng.randrange(1000), shared=True)
    if shape == "scattered":  # the scratch path: gather, hash, scatter
        dst, src = pick_blocks(rng, 9), pick_blocks(rng, 9)
    else:  # the straight path: runs on both sides, cut where either side's run breaks
        dst, src = consecutive(3, 5) + consecutive(20, 4), consecutive(30, 2) + consecutive(9, 7)
    before = piece_counts(receiver)
    ready, sent = hand_off(receiver, sender, f"reads-{dtype}-{shape}", dst, src, layout,
                           layers_per_piece=1)
    assert ready["ok"] and sent["ok"], (ready, sent)
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
    # One piece per layer (as asked), all read: no payload crossed UCX.
    assert landed_since(receiver, before) == {"read": layout.num_local_layers, "direct": 0,
                                              "staged": 0}
    assert ready["num_pieces"] == layout.num_local_layers
    assert sent["num_bytes_sent"] == ready["num_bytes"]
    assert receiver.call("receiver_stats")["writable_block_ids"] == []
    assert receiver.call("receiver_stats")["num_slotted_transfers"] >= 1
    # UCX maps the sender's cache read-write; it is only readable through our view (the
    # slots region is writable: the receiver rings its bell word there).
    assert receiver.call("peer_maps_writable") == {
        len(sender.call("read", block_ids=list(range(CACHE_BLOCKS)))): False,
        REGION_BYTES: True}


@pytest.mark.parametrize("slots", [True, False])
def test_reads_announced_by_slot_or_by_frames_land_the_same(pair, slots: bool) -> None:
    """A transfer that gets no read slot (all leased) announces its pieces by PIECE frames."""
    receiver, sender = pair
    rng = random.Random("reads-channel")
    layout = random_layout(rng, "float16", num_layers=5)
    assert setup_roles(receiver, sender, layout, seed=5, shared=True)
    dst, src = pick_blocks(rng, 7), pick_blocks(rng, 7)
    slotted_before = receiver.call("receiver_stats")["num_slotted_transfers"]
    reads_before = piece_counts(receiver)["read"]
    ready, sent = hand_off(receiver, sender, f"reads-channel-{slots}", dst, src, layout,
                           layers_per_piece=1, allow_slots=slots)
    assert ready["ok"] and sent["ok"], (ready, sent)
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
    stats = receiver.call("receiver_stats")
    assert stats["num_slotted_transfers"] - slotted_before == int(slots)
    assert stats["num_read_pieces"] - reads_before == layout.num_local_layers
    wait_slots_returned(sender)


def test_a_watching_receiver_starts_from_the_slot_before_the_frames_arrive(pair) -> None:
    """Once a receiver follows a sender's slots, the sender's next transfer begins in its
    slot: the receiver reads and is ready before the (here held back 3 s) BEGIN and SOURCE
    frames would leave, marks the slot, and the sender then sends neither."""
    receiver, sender = pair
    rng = random.Random("reads-slot-begin")
    layout = random_layout(rng, "float16", num_layers=4)
    assert setup_roles(receiver, sender, layout, seed=23, shared=True,
                       sender_faults={"begin_frames_delay_s": 3.0})
    begun = receiver.call("receiver_stats")["num_slot_begun"]
    unsent = sender.call("sender_stats")["num_begun_in_slot"]
    for attempt in ("cold", "warm"):
        dst, src = pick_blocks(rng, 6), pick_blocks(rng, 6)
        pushed_at = sender.call("now")
        ready, sent = hand_off(receiver, sender, f"slot-begin-{attempt}", dst, src, layout,
                               layers_per_piece=1)
        assert ready["ok"] and sent["ok"], (attempt, ready, sent)
        assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
        stats = receiver.call("receiver_stats")
        if attempt == "cold":  # no watcher yet: it had to wait for the frames
            assert ready["ended_at"] - pushed_at >= 3.0
            assert stats["num_slot_begun"] == begun
        else:
            assert ready["ended_at"] - pushed_at < 3.0
            assert stats["num_slot_begun"] == begun + 1
            assert sender.call("sender_stats")["num_begun_in_slot"] == unsent + 1
    assert stats["num_failed"] == 0 and stats["writable_block_ids"] == []
    wait_slots_returned(sender)


def test_a_torn_begin_record_leaves_the_transfer_to_its_frames(pair) -> None:
    receiver, sender = pair
    rng = random.Random("reads-torn-begin")
    layout = random_layout(rng, "bfloat16", num_layers=3)
    assert setup_roles(receiver, sender, layout, seed=29, shared=True,
                       sender_faults={"corrupt_slot_record": -1})
    begun = receiver.call("receiver_stats")["num_slot_begun"]
    for attempt in range(2):  # the second one finds the watcher running
        dst, src = pick_blocks(rng, 5), pick_blocks(rng, 5)
        ready, sent = hand_off(receiver, sender, f"torn-begin-{attempt}", dst, src, layout,
                               layers_per_piece=1)
        assert ready["ok"] and sent["ok"], (ready, sent)
        assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
    stats = receiver.call("receiver_stats")
    assert stats["num_slot_begun"] == begun and stats["writable_block_ids"] == []
    wait_slots_returned(sender)


def faulty_read(pair, name: str, dtype: str, num_layers: int, num_blocks: int, seed: int,
                **faults: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """One read transfer between fresh roles with ``faults`` (``sender_faults=`` /
    ``receiver_faults=``), one piece per layer; returns (receiver outcome, sender outcome,
    the source's and the destination's bytes from before the transfer)."""
    receiver, sender = pair
    rng = random.Random(name)
    layout = random_layout(rng, dtype, num_layers=num_layers)
    assert setup_roles(receiver, sender, layout, seed=seed, shared=True, **faults)
    dst, src = pick_blocks(rng, num_blocks), pick_blocks(rng, num_blocks)
    def contents(suffix: str) -> dict[str, bytes]:
        return {"src" + suffix: sender.call("read", block_ids=src),
                "dst" + suffix: receiver.call("read", block_ids=dst)}

    data = contents("")
    ready, sent = hand_off(receiver, sender, name, dst, src, layout, layers_per_piece=1)
    return ready, sent, {**data, **contents(" after")}


def test_a_torn_slot_record_fails_the_transfer_and_releases_the_blocks(pair) -> None:
    receiver, sender = pair
    ready, sent, _ = faulty_read(pair, "reads-torn", "float16", 3, 4, 9,
                                 sender_faults={"corrupt_slot_record": 1})
    assert ready["code"] == "protocol" and "fails its check" in ready["message"], ready
    assert sent["code"] == "protocol", sent
    assert receiver.call("receiver_stats")["writable_block_ids"] == []
    wait_slots_returned(sender)


def test_sixteen_concurrent_reads_land_in_their_own_blocks(pair) -> None:
    receiver, sender = pair
    rng = random.Random("reads-16")
    layout = random_layout(rng, "float16", num_layers=3)
    assert setup_roles(receiver, sender, layout, seed=41, shared=True)
    order = rng.sample(range(CACHE_BLOCKS), CACHE_BLOCKS)
    dsts = [order[3 * i:3 * i + 3] for i in range(16)]
    srcs = [rng.sample(range(CACHE_BLOCKS), 3) for _ in range(16)]
    tickets = [reserve(receiver, f"many-{i}", dsts[i], layout) for i in range(16)]
    pushed = sender.call("push", tickets=tickets, block_ids=srcs, first_token_id=100)
    for i in range(16):
        ready = receiver.call("wait", request_id=f"many-{i}", timeout=20)
        assert ready["ok"] and ready["first_token_id"] == 100 + i, ready
        assert sender.call("result", handle=pushed["handles"][i], timeout=20)["ok"]
        assert receiver.call("read", block_ids=dsts[i]) == sender.call("read", block_ids=srcs[i])


def test_a_bad_read_fails_with_a_digest_reason(pair) -> None:
    receiver, _ = pair
    ready, sent, data = faulty_read(pair, "reads-corrupt", "bfloat16", 4, 4, 7,
                                    receiver_faults={"corrupt_read_piece": 2})
    assert ready["code"] == "digest" and "piece 2" in ready["message"], ready
    assert ready["blocks_released"] and sent["code"] == "digest", sent
    assert data["src after"] == data["src"]  # reads never write the source
    assert receiver.call("receiver_stats")["writable_block_ids"] == []


def test_cancel_during_reads_stops_all_writes(pair) -> None:
    receiver, sender = pair
    rng = random.Random("reads-cancel")
    layout = random_layout(rng, "float16", num_layers=6)
    assert setup_roles(receiver, sender, layout, seed=19, shared=True,
                       receiver_faults={"recv_delay_s": 0.5})
    dst, src = pick_blocks(rng, 5), pick_blocks(rng, 5)
    before, reads_before = receiver.call("read", block_ids=dst), piece_counts(receiver)["read"]
    drained_before = receiver.call("receiver_stats")["num_drained"]
    ticket = reserve(receiver, "reads-mid", dst, layout)
    pushed = sender.call("push", tickets=[ticket], block_ids=[src], first_token_id=1,
                         layers_per_piece=1)
    wait_until(lambda: receiver.call("receiver_stats")["num_receiving"] == 1, 5, "begun")
    assert receiver.call("cancel", request_id="reads-mid")
    sent = sender.call("result", handle=pushed["handles"][0], timeout=20)
    assert sent["code"] == "cancelled", sent
    # Every read handed on before the cancel was still held back by the delay; when it ends,
    # each finds the transfer over and copies nothing (drained: its transfer had ended).
    wait_until(lambda: receiver.call("receiver_stats")["num_pending_reads"] == 0, 10,
               "every delayed read to find the transfer over")
    drained = receiver.call("receiver_stats")["num_drained"] - drained_before
    assert drained <= layout.num_local_layers
    assert receiver.call("read", block_ids=dst) == before
    assert piece_counts(receiver)["read"] == reads_before
    assert receiver.call("receiver_stats")["writable_block_ids"] == []


def test_deferred_free_holds_the_source_blocks_until_the_reads_are_over(pair) -> None:
    receiver, sender = pair
    rng = random.Random("reads-slow")
    layout = random_layout(rng, "float32", num_layers=2)
    delay = 1.0
    assert setup_roles(receiver, sender, layout, seed=13, shared=True,
                       receiver_faults={"recv_delay_s": delay})
    dst, src = pick_blocks(rng, 4), pick_blocks(rng, 4)
    ticket = reserve(receiver, "reads-slow", dst, layout)
    pushed = sender.call("push", tickets=[ticket], block_ids=[src], first_token_id=1)
    check_deferred_free(receiver, sender, "reads-slow", pushed, delay, dst, src)


def test_reads_can_be_declined_per_transfer(pair) -> None:
    receiver, sender = pair
    rng = random.Random("reads-declined")
    layout = random_layout(rng, "float16", num_layers=3)
    assert setup_roles(receiver, sender, layout, seed=3, shared=True)
    dst, src = pick_blocks(rng, 4), pick_blocks(rng, 4)
    before = piece_counts(receiver)
    ready, sent = hand_off(receiver, sender, "reads-declined", dst, src, layout,
                           allow_reads=False)
    assert ready["ok"] and sent["ok"]
    landed = landed_since(receiver, before)
    assert landed["read"] == 0 and landed["staged"] + landed["direct"] == ready["num_pieces"]
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)


@pytest.mark.parametrize("shift", [1 << 40, -(1 << 20)])
def test_a_source_outside_the_shared_region_is_refused(pair, shift: int) -> None:
    receiver, _ = pair
    ready, sent, data = faulty_read(pair, "reads-lie", "float16", 2, 3, 2,
                                    sender_faults={"source_address_shift": shift})
    assert ready["code"] == "protocol" and "cannot map" in ready["message"], ready
    assert not sent["ok"] and data["dst after"] == data["dst"]
    assert receiver.call("receiver_stats")["writable_block_ids"] == []


@pytest.fixture
def lone_receiver() -> Iterator[Agent]:
    (agent,) = spawn_agents(None)
    yield agent
    agent.stop()


def test_sender_killed_mid_stream_releases_the_reservation_and_stalls_nothing(
        lone_receiver) -> None:
    receiver = lone_receiver
    doomed, successor = spawn_agents(None, None)
    layout, dst, src = kill_sender_midstream(
        receiver, doomed, "reads-orphan", shared=True, deadline_s=4.0,
        in_flight=lambda _: receiver.call("receiver_stats")["num_read_pieces"] >= 3)
    assert receiver.call("receiver_stats")["writable_block_ids"] == []
    # No payload went through UCX's shared-memory FIFO, so the kill left nothing stalled:
    # the same receiver serves the next sender at once.
    successor.call("make_cache", layout=layout.to_dict(), num_blocks=CACHE_BLOCKS, seed=5,
                   shared=True)
    assert successor.call("make_sender")
    started = time.monotonic()
    ready, sent = hand_off(receiver, successor, "reads-next", dst, src, layout)
    assert ready["ok"] and sent["ok"] and time.monotonic() - started < 2.0, (ready, sent)
    successor.stop()
