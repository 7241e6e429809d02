"""Building blocks for the two-process handoff tests: layouts, role setup, a killed sender."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.kv.layout import KVLayout
from tests.handoff.handoff_agent import Agent
from tests.support.waiting import wait_for

CACHE_BLOCKS = 48


def random_layout(rng: random.Random, dtype: str, **overrides: Any) -> KVLayout:
    values: dict[str, Any] = {
        "model_fingerprint": f"tiny-{rng.randrange(1 << 30):x}",
        "dtype": dtype,
        "block_size": rng.choice([1, 4, 16]),
        "num_layers": rng.randint(2, 6),
        "num_kv_heads": rng.randint(1, 4),
        "head_dim": rng.choice([8, 16, 64]),
    }
    values.update(overrides)
    return KVLayout(**values)


def setup_roles(receiver: Agent, sender: Agent, layout: KVLayout, *, seed: int = 0,
                receiver_faults: dict[str, Any] | None = None,
                sender_faults: dict[str, Any] | None = None,
                sender_layout: KVLayout | None = None) -> None:
    """Fresh caches (random bytes, different per side) and fresh roles on both agents."""
    receiver.call("make_cache", layout=layout.to_dict(), num_blocks=CACHE_BLOCKS, seed=seed)
    receiver.call("make_receiver", **(receiver_faults or {}))
    sender.call("make_cache", layout=(sender_layout or layout).to_dict(),
                num_blocks=CACHE_BLOCKS, seed=seed + 1)
    sender.call("make_sender", **(sender_faults or {}))


def pick_blocks(rng: random.Random, count: int, exclude: set[int] | None = None) -> list[int]:
    """Distinct, unordered, non-contiguous block ids."""
    free = [b for b in range(CACHE_BLOCKS) if b not in (exclude or set())]
    return rng.sample(free, count)


def reserve(receiver: Agent, request_id: str, block_ids: list[int], layout: KVLayout,
            timeout_s: float = 10.0, num_tokens: int | None = None) -> dict[str, Any]:
    tokens = num_tokens if num_tokens is not None else len(block_ids) * layout.block_size - 1
    return receiver.call("reserve", request_id=request_id, block_ids=block_ids,
                         num_tokens=max(1, tokens), timeout_s=timeout_s)


def push_one(sender: Agent, ticket: dict[str, Any], src: list[int], first_token_id: int = 1,
             layers_per_piece: int | None = None) -> dict[str, Any]:
    """The sender pushes its blocks ``src`` into one reserved ``ticket``; its answer (the
    transfer's ``handles`` and ``started_at``)."""
    pieces = {} if layers_per_piece is None else {"layers_per_piece": layers_per_piece}
    return sender.call("push", tickets=[ticket], block_ids=[src],
                       first_token_id=first_token_id, **pieces)


def check_deferred_free(receiver: Agent, sender: Agent, request_id: str,
                        pushed: dict[str, Any], delay: float, dst: list[int],
                        src: list[int]) -> None:
    """A receiver slowed by ``delay`` before each piece has the first transfer of ``pushed``
    in flight: the source blocks stay pinned until it is over, then the KV is ready and exact
    (the deferred-free contract)."""
    handle = pushed["handles"][0]
    time.sleep(delay / 2)  # observation point inside the receiver's delay, not a wait
    assert not sender.call("released", handle=handle), "source blocks released before the data left"
    sent = sender.call("result", handle=handle, timeout=20)
    assert sent["ok"], sent
    # The transfer could only end once the slow receiver took its pieces.
    assert sent["released_at"] - pushed["started_at"] >= delay
    assert receiver.call("wait", request_id=request_id, timeout=20)["ok"]
    assert receiver.call("read", block_ids=dst) == sender.call("read", block_ids=src)


def kill_sender_midstream(receiver: Agent, doomed: Agent, request_id: str, *, deadline_s: float,
                          in_flight: Callable[[list[int]], bool]) -> tuple[KVLayout, list[int],
                                                                           list[int]]:
    """``doomed`` sends half of a transfer's layers (no fence) and is killed -9 once
    ``in_flight(dst)`` holds; checks the receiver's ticket failed by its deadline with its
    blocks released. Returns (layout, dst, src)."""
    rng = random.Random(request_id)
    layout = random_layout(rng, "float32", num_layers=6, num_kv_heads=4, head_dim=64)
    setup_roles(receiver, doomed, layout, seed=23)
    dst, src = pick_blocks(rng, 8), pick_blocks(rng, 8)
    reserved_at = receiver.call("now")
    ticket = reserve(receiver, request_id, dst, layout, timeout_s=deadline_s)
    handle = doomed.call("start", ticket=ticket, block_ids=src, layers_per_piece=1)
    doomed.call("send_layers", handles=[handle], layers=[0, 1, 2])  # half the layers, no fence
    wait_for(lambda: in_flight(dst), 5, "the transfer under way")
    doomed.kill()
    outcome = receiver.call("wait", request_id=request_id, timeout=deadline_s + 5)
    assert not outcome["ok"] and outcome["code"] in ("peer_gone", "timeout"), outcome
    assert outcome["ended_at"] <= reserved_at + deadline_s + 0.5  # heartbeats beat the deadline
    assert not set(dst) & set(receiver.call("receiver_stats")["writable_block_ids"])
    return layout, dst, src
