"""KV handoff between two real OS processes over UCXX loopback: round trips, concurrency,
deferred free, drained pieces. (Faults and refusals: test_faults.py.)
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.handoff.handoff_agent import Agent
from tests.handoff.handoff_cases import (
    check_deferred_free,
    pick_blocks,
    push_one,
    random_layout,
    reserve,
    setup_roles,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


def _round_trip(receiver: Agent, sender: Agent, layout, rng: random.Random, request_id: str,
                num_blocks: int, layers_per_piece: int | None) -> None:
    dst, src = pick_blocks(rng, num_blocks), pick_blocks(rng, num_blocks)
    ticket = reserve(receiver, request_id, dst, layout)
    pushed = push_one(sender, ticket, src, 7, layers_per_piece=layers_per_piece)
    ready = receiver.call("wait", request_id=request_id, timeout=20)
    assert ready["ok"], ready
    assert ready["first_token_id"] == 7
    assert ready["num_bytes"] == ticket["expected_bytes"]
    sent = sender.call("result", handle=pushed["handles"][0], timeout=20)
    assert sent["ok"], sent
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_byte_exact_for_random_layouts_and_groupings(pair, dtype: str) -> None:
    receiver, sender = pair
    rng = random.Random(f"round-trip-{dtype}")
    layout = random_layout(rng, dtype)
    setup_roles(receiver, sender, layout, seed=rng.randrange(1000))
    for grouping in (1, 2, None):  # one layer per piece, pairs, sized by min_piece_bytes
        _round_trip(receiver, sender, layout, rng, f"{dtype}-{grouping}",
                    rng.randint(1, 9), grouping)
    assert receiver.call("receiver_stats")["writable_block_ids"] == []


def test_round_trip_of_a_pipeline_stage_layer_range(pair) -> None:
    receiver, sender = pair
    rng = random.Random("stage")
    layout = random_layout(rng, "bfloat16", num_layers=7, layer_start=2, layer_end=5)
    setup_roles(receiver, sender, layout, seed=3)
    _round_trip(receiver, sender, layout, rng, "stage", 5, 2)


def test_round_trip_splits_layers_larger_than_a_piece(pair) -> None:
    receiver, sender = pair
    rng = random.Random("split")
    # 64 KiB per block and layer; 20 blocks = 1.25 MiB per layer > the 1 MiB piece bound.
    layout = random_layout(rng, "float32", block_size=16, num_kv_heads=4, head_dim=64,
                           num_layers=2)
    setup_roles(receiver, sender, layout, seed=5)
    _round_trip(receiver, sender, layout, rng, "split", 20, None)


def test_head_ranges_of_one_block_arrive_as_separate_transfers_from_tp_ranks(pair) -> None:
    """The receiver holds all 4 KV heads; the sender is TP rank 1 of 2 (heads 2-3). Its
    transfer fills heads 2-3 of the reserved blocks while a second reservation of heads 0-1 of
    the same blocks stays open (another rank's, never sent): blocks are shared by head, the
    heads sent land byte-exact, the others are not written."""
    receiver, sender = pair
    rng = random.Random("heads")
    layout = random_layout(rng, "bfloat16", num_kv_heads=4, num_layers=3)
    rank1 = replace(layout, tp_rank=1, tp_size=2)
    setup_roles(receiver, sender, layout, seed=13, sender_layout=rank1)
    dst, src = pick_blocks(rng, 5), pick_blocks(rng, 5)
    before = receiver.call("read", block_ids=dst, local_heads=[0, 2])
    tokens = 5 * layout.block_size
    other = receiver.call("reserve", request_id="r/h0", block_ids=dst, num_tokens=tokens,
                          kv_heads=[0, 2])
    ticket = receiver.call("reserve", request_id="r/h2", block_ids=dst, num_tokens=tokens,
                           kv_heads=[2, 4])
    assert ticket["expected_bytes"] == other["expected_bytes"] == 3 * 5 * layout.block_bytes // 2
    pushed = push_one(sender, ticket, src, first_token_id=3)
    assert receiver.call("wait", request_id="r/h2", timeout=20)["ok"]
    assert sender.call("result", handle=pushed["handles"][0], timeout=20)["ok"]
    assert (receiver.call("read", block_ids=dst, local_heads=[2, 4])
            == sender.call("read", block_ids=src))
    assert receiver.call("read", block_ids=dst, local_heads=[0, 2]) == before
    assert sorted(receiver.call("receiver_stats")["writable_block_ids"]) == sorted(dst)
    assert receiver.call("cancel", request_id="r/h0") is True
    assert receiver.call("receiver_stats")["writable_block_ids"] == []


def test_sixteen_concurrent_transfers_share_one_endpoint_and_land_in_their_own_blocks(pair) -> None:
    receiver, sender = pair
    rng = random.Random("sixteen")
    layout = random_layout(rng, "float16", num_layers=3, block_size=4)
    setup_roles(receiver, sender, layout, seed=11)
    dst_all = pick_blocks(rng, 32)
    src_all = pick_blocks(rng, 32)
    dst = [dst_all[2 * i : 2 * i + 2] for i in range(16)]
    src = [src_all[2 * i : 2 * i + 2][:: 1 if i % 2 else -1] for i in range(16)]
    tickets = [reserve(receiver, f"many-{i}", dst[i], layout) for i in range(16)]
    pushed = sender.call("push", tickets=tickets, block_ids=src, first_token_id=100)
    for i in range(16):
        ready = receiver.call("wait", request_id=f"many-{i}", timeout=30)
        assert ready["ok"], ready
        assert ready["first_token_id"] == 100 + i  # each fence reached its own ticket
    for i, handle in enumerate(pushed["handles"]):
        assert sender.call("result", handle=handle, timeout=30)["ok"]
        assert receiver.call("read", block_ids=dst[i]) == sender.call("read", block_ids=src[i])
    assert sender.call("sender_stats")["num_links"] == 1  # one endpoint pair for all 16


def test_deferred_free_waits_for_a_slow_receiver(pair) -> None:
    receiver, sender = pair
    rng = random.Random("slow")
    layout = random_layout(rng, "float32", num_layers=2)
    delay = 1.0
    setup_roles(receiver, sender, layout, seed=13, receiver_faults={"recv_delay_s": delay})
    dst, src = pick_blocks(rng, 4), pick_blocks(rng, 4)
    ticket = reserve(receiver, "slow", dst, layout)
    pushed = push_one(sender, ticket, src)
    check_deferred_free(receiver, sender, "slow", pushed, delay, dst, src)


def test_pieces_of_cancelled_or_unknown_transfers_are_drained_never_written(pair) -> None:
    receiver, sender = pair
    rng = random.Random("drain")
    layout = random_layout(rng, "float32", num_layers=4)
    setup_roles(receiver, sender, layout, seed=17)
    dst, src = pick_blocks(rng, 6), pick_blocks(rng, 6)
    before = receiver.call("read", block_ids=dst)

    cancelled = reserve(receiver, "cancelled", dst, layout)
    assert receiver.call("cancel", request_id="cancelled")
    unknown = dict(cancelled, transfer_id=cancelled["transfer_id"] ^ 0x5A5A5A5A, request_id="ghost")
    pushed = sender.call("push", tickets=[cancelled, unknown], block_ids=[src, src],
                         first_token_id=3, layers_per_piece=1)
    results = [sender.call("result", handle=h, timeout=20) for h in pushed["handles"]]
    assert [r["code"] for r in results] == ["cancelled", "unknown_transfer"]
    wait_for(lambda: receiver.call("receiver_stats")["num_drained"] >= 1, 10, "drained pieces")
    assert receiver.call("read", block_ids=dst) == before
    outcome = receiver.call("wait", request_id="cancelled", timeout=5)
    assert outcome["code"] == "cancelled"


def test_cancel_during_transfer_stops_all_writes(pair) -> None:
    receiver, sender = pair
    rng = random.Random("cancel-mid")
    layout = random_layout(rng, "float16", num_layers=6)
    setup_roles(receiver, sender, layout, seed=19, receiver_faults={"recv_delay_s": 1.0})
    dst, src = pick_blocks(rng, 5), pick_blocks(rng, 5)
    ticket = reserve(receiver, "mid", dst, layout)
    pushed = push_one(sender, ticket, src, layers_per_piece=1)
    time.sleep(0.5)  # every piece is announced; its buffer is posted only after the delay
    assert receiver.call("cancel", request_id="mid")
    after_cancel = receiver.call("read", block_ids=dst)
    sent = sender.call("result", handle=pushed["handles"][0], timeout=20)
    assert sent["code"] == "cancelled", sent  # the receiver's verdict reached the sender
    assert receiver.call("read", block_ids=dst) == after_cancel
    assert dst[0] not in receiver.call("receiver_stats")["writable_block_ids"]


def _linked(pair, name: str, seed: int):  # type: ignore[no-untyped-def]
    """The pair's roles set up on a fresh layout, their link made by a first round trip;
    then a second round trip, to call after whatever the test does meanwhile."""
    receiver, sender = pair
    rng = random.Random(name)
    layout = random_layout(rng, "float16", num_layers=2)
    setup_roles(receiver, sender, layout, seed=seed)
    _round_trip(receiver, sender, layout, rng, f"before-{name}", 2, None)
    return lambda: _round_trip(receiver, sender, layout, rng, f"after-{name}", 2, None)


def test_an_idle_pooled_link_still_works_after_the_peer_timeout(pair) -> None:
    again = _linked(pair, "idle", 23)
    time.sleep(2.5)  # longer than peer_timeout_s (1.5 s): heartbeats must keep the session
    started = time.monotonic()
    again()
    assert time.monotonic() - started < 1.5
    assert pair[1].call("sender_stats")["num_links"] == 1


def _wakeups(pid: int) -> int:
    """Voluntary context switches of all the process's threads so far (each is a wakeup
    from a wait)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that ended since the listing
            continue
        total += int(text.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def test_an_idle_transport_sleeps_between_events(pair) -> None:
    # ucxx's own progress thread waits 1 ms at a time: about 1,000 wakeups a second on an idle
    # process (measured: 939), each taking the core from the engine's step.
    again = _linked(pair, "quiet", 29)
    receiver = pair[0]
    before, started = _wakeups(receiver.pid), time.monotonic()
    time.sleep(1.0)  # the measurement window: an idle second
    rate = (_wakeups(receiver.pid) - before) / (time.monotonic() - started)
    assert rate < 300, f"{rate:.0f} wakeups/s while idle"
    again()  # and events still wake it
