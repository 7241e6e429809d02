"""Fuzzed frames between two real processes: an authenticated sender sends BEGIN, PIECE, FENCE
and ABORT frames with random fields, and payloads of random sizes, at a real receiver. It
never crashes, never writes outside the reserved blocks, and serves a correct transfer after.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.handoff.digest import HOST_DIGEST
from pdserve.handoff.wire import Kind, piece_entry
from tests.handoff.handoff_cases import (
    CACHE_BLOCKS,
    pick_blocks,
    push_one,
    random_layout,
    reserve,
    setup_roles,
)

pytestmark = pytest.mark.timeout(300)
LAYOUT = random_layout(random.Random("frame-fuzz"), "float16", num_layers=3, block_size=4,
                       num_kv_heads=1, head_dim=8)
ROW = LAYOUT.block_bytes // 2
ints = st.integers(-2, 12) | st.integers(-(1 << 63), (1 << 63) - 1)


@st.composite
def attacks(draw: st.DrawFn, ticket: dict) -> tuple[list, list]:
    tid = draw(st.sampled_from([ticket["transfer_id"], ticket["transfer_id"] ^ 1]))
    begin = {"tid": tid, "instance": draw(st.sampled_from([ticket["receiver_instance"], 7])),
             "request_id": draw(st.sampled_from([ticket["request_id"], "x"])),
             "layout": draw(st.sampled_from([LAYOUT.to_dict(), {"dtype": "float16"}])),
             "num_blocks": draw(st.sampled_from([ticket["num_blocks"], 99])),
             "digest": draw(st.sampled_from([HOST_DIGEST, "crc"]))}
    frames = [(int(Kind.BEGIN), begin)] if draw(st.booleans()) else []
    entries = [piece_entry(draw(ints), (draw(ints), draw(ints)), (draw(ints), draw(ints)),
                           (draw(ints), draw(ints)), draw(st.sampled_from([ROW, 2 * ROW]) | ints),
                           draw(ints)) for _ in range(draw(st.integers(0, 5)))]
    frames.append((int(Kind.PIECE), {"tid": tid, "pieces": entries}))
    if draw(st.booleans()):
        frames.append((int(Kind.FENCE), {"tid": tid, "num_pieces": draw(ints),
                                         "nbytes": draw(ints), "digest": draw(ints),
                                         "first_token_id": draw(ints), "num_tokens": draw(ints)}))
    if draw(st.booleans()):
        frames.append((int(Kind.ABORT_TO_RECEIVER), {"tid": tid, "code": draw(st.text(max_size=5)),
                                                     "message": "fuzz"}))
    payloads = [(tid, draw(st.integers(0, 6)), draw(st.integers(1, 4 * ROW)))
                for _ in range(draw(st.integers(0, 3)))]
    return frames, payloads


def test_fuzzed_frames_never_crash_the_receiver_nor_write_outside_a_reservation(pair) -> None:
    receiver, sender = pair
    setup_roles(receiver, sender, LAYOUT, seed=9)
    rng = random.Random(0)
    counter = iter(range(1 << 30))

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def attack(data: st.DataObject) -> None:
        dst = pick_blocks(rng, 4)
        outside = sorted(set(range(CACHE_BLOCKS)) - set(dst))
        before = receiver.call("read", block_ids=outside)
        ticket = reserve(receiver, f"fuzz-{next(counter)}", dst, LAYOUT, timeout_s=3)
        frames, payloads = data.draw(attacks(ticket))
        sender.call("send_frames", ticket=ticket, frames=frames, payloads=payloads)
        receiver.call("cancel", request_id=ticket["request_id"])
        assert receiver.call("read", block_ids=outside) == before
        assert not set(dst) & set(receiver.call("receiver_stats")["writable_block_ids"])

    attack()
    # The same processes still move KV exactly.
    dst, src = pick_blocks(rng, 3), pick_blocks(rng, 3)
    ticket = reserve(receiver, "after-fuzz", dst, LAYOUT)
    push_one(sender, ticket, src, first_token_id=4)
    assert receiver.call("wait", request_id="after-fuzz", timeout=20)["ok"]
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)
