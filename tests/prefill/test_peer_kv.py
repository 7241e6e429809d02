"""Choosing the source of a prefix pull (the replica, other than the puller, whose device
cache holds the most of the prompt's leading blocks), and the source's refusals."""

from __future__ import annotations

import asyncio
import time

from pdserve.cluster.config import engine_config
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_layout import KVSlice
from pdserve.engine.sampling_params import SamplingParams
from pdserve.handoff import HandoffTicket
from pdserve.prefill.peer_kv import PeerSendRequest, PeerSource, best_source
from pdserve.prefill.peer_source import send_cached


def ticket_bytes(engine: LLMEngine, num_blocks: int) -> int:
    kv = KVSlice.whole(engine.layout)
    return kv.num_local_layers * num_blocks * kv.block_bytes


def test_the_longest_other_holder_is_the_source() -> None:
    held = (("me", 9), ("b", 3), ("c", 6), ("d", 0))
    assert best_source(held, "me") == PeerSource("c", 6)
    assert best_source((("me", 9),), "me") is None
    assert best_source((), "me") is None


def test_the_source_refuses_what_it_cannot_send_and_pins_nothing(
        tiny_checkpoints: dict[str, str]) -> None:
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=32))
    async_engine = AsyncEngine(engine)
    try:
        prompt = list(range(3, 70))
        engine_tokens = engine.generate([prompt], SamplingParams(max_tokens=1))  # caches 4
        assert engine_tokens and engine.kv_manager.num_cached_blocks >= 4
        ticket = HandoffTicket("r/peer", 7, b"addr", 1, "host", 2, 32,
                               ticket_bytes(engine, 2),
                               1 << 20, time.time() + 30, engine.layout).to_dict()
        # Blocks 2 and 3 of another token sequence: not cached here.
        miss = PeerSendRequest("r/peer", ticket, list(range(100, 164)), 2, "me")
        # No sender: a refusal never reaches one.
        assert asyncio.run(send_cached(async_engine, None, miss)) == "peer_miss"  # type: ignore[arg-type]
        bad = PeerSendRequest("r/peer", ticket | {"num_blocks": -1}, prompt[:64], 2, "me")
        assert asyncio.run(send_cached(async_engine, None, bad)) == "bad_ticket"  # type: ignore[arg-type]
        # A ticket for fewer blocks than the request names: refused, the pins dropped.
        short = PeerSendRequest("r/peer", ticket, prompt[:64], 1, "me")
        assert asyncio.run(send_cached(async_engine, None, short)) == "peer_miss"  # type: ignore[arg-type]
        assert engine.kv_manager.num_pinned_for_peers == 0
        asyncio.run(async_engine.call(engine.kv_stats))  # integrity
    finally:
        async_engine.shutdown()
        engine.close()
