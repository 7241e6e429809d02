"""Choosing the source of a prefix pull (the replica, other than the puller, whose device or
host tier holds the most of the prompt's leading blocks), the source's refusals, and a source
whose blocks sit in its host tier bringing them back to device KV to send them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from types import SimpleNamespace
from typing import Any

import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.cache import kv_cache_bytes
from pdserve.engine.kv.layout import KVSlice
from pdserve.engine.sampling_params import SamplingParams
from pdserve.handoff import HandoffTicket
from pdserve.prefill.peer_kv import PeerSendRequest, PeerSource, best_source
from pdserve.prefill.peer_source import send_cached
from tests.support.kv_tiers import run, settle
from tests.support.waiting import wait_for


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
    prompt = list(range(3, 70))
    # Before the engine thread starts: it would step the engine too, taking the answer.
    engine_tokens = engine.generate([prompt], SamplingParams(max_tokens=1))  # caches 4
    assert engine_tokens and engine.kv_manager.num_cached_blocks >= 4
    async_engine = AsyncEngine(engine)
    try:
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


class RecordingSender:
    """A sender stand-in that records what the source sends and releases at the fence."""

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.layers: list[int] = []
        self.fenced = False

    def start_transfer(self, ticket: HandoffTicket, block_ids: list[int], layout: object) -> Any:
        self.block_ids = list(block_ids)
        return SimpleNamespace(released=concurrent.futures.Future())

    def send_layer(self, cache: object, layer: int, transfers: list[Any]) -> None:
        self.layers.append(layer)

    def send_fence(self, transfer: Any, token: int) -> None:
        self.fenced = True
        transfer.released.set_result(SimpleNamespace(ok=True))


def test_a_prefix_evicted_to_the_host_tier_comes_back_to_device_and_is_sent(
        tiny_checkpoints: dict[str, str]) -> None:
    path = tiny_checkpoints["llama"]
    probe = LLMEngine(engine_config(path, num_kv_blocks=1))
    block_bytes = kv_cache_bytes(probe.layout, 1)
    probe.close()
    engine = LLMEngine(engine_config(path, num_kv_blocks=12, kv_load_policy="always",
                                     host_kv_cache_gb=40 * block_bytes / 2**30))
    reference = LLMEngine(engine_config(path, num_kv_blocks=32, enable_prefix_caching=False))
    rng = random.Random(5)
    vocab = engine.loaded.config.vocab_size
    prompt, *others = [[rng.randrange(3, vocab) for _ in range(70)] for _ in range(4)]
    run(engine, {"doc": prompt})
    run(engine, {f"other{i}": other for i, other in enumerate(others)})  # evicts doc's blocks
    settle(engine)
    prefix = prompt[:64]
    assert engine.kv_manager.pin_cached("probe", prefix, 0) is None, "evicted from device"
    assert engine.kv_manager.held_in_host_tier(prefix, 1)
    loads = engine.tiers.stats().num_host_loads
    async_engine = AsyncEngine(engine)
    try:
        sender = RecordingSender()
        ticket = HandoffTicket("r/peer", 7, b"addr", 1, "host", 3, 48,
                               ticket_bytes(engine, 3), 1 << 20, time.time() + 30,
                               engine.layout).to_dict()
        ask = PeerSendRequest("r/peer", ticket, prefix, 1, "me")
        assert asyncio.run(send_cached(async_engine, sender, ask)) is None  # type: ignore[arg-type]
        assert sender.fenced and sender.layers == list(range(engine.layout.num_local_layers))
        assert engine.tiers.stats().num_host_loads > loads, "the prefix came from the host tier"
        # The blocks sent hold the prefix's KV, as one engine computes it alone.
        reference.generate([prompt], SamplingParams(max_tokens=1))
        want = reference.kv_cache[:, :, list(range(1, 4))]
        assert want.abs().sum() > 0
        got = engine.kv_cache[:, :, sender.block_ids]
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        wait_for(lambda: engine.kv_manager.num_pinned_for_peers == 0, 10, "the pins to drop")
        asyncio.run(async_engine.call(engine.kv_stats))  # integrity
    finally:
        async_engine.shutdown()
        engine.close()
        reference.close()
