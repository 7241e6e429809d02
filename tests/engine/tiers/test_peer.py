"""The peer tier on a real tiny model, engine side: a prefix another engine caches is pulled
into reserved device blocks, used only after the pull reported its end, and the greedy tokens
equal a one-engine run; a failed pull (garbage in the blocks) computes the prefix instead; an
abort mid-pull frees the blocks at the pull's end; the cost model declines a pull whose
estimate loses; the source's pins hold blocks only while a pull reads them."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.cache import kv_cache_bytes
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiers.cost import KVCostModel
from tests.support.kv_tiers import run, settle

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints: dict[str, str]) -> LoadedModel:
    return LoadedModel.load(tiny_checkpoints["llama"], torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def path(tiny_checkpoints: dict[str, str]) -> str:
    return tiny_checkpoints["llama"]


@dataclass
class Pull:
    request_id: str
    token_ids: list[int]
    first_block: int
    device_ids: list[int]


@dataclass
class CopyPeer:
    """Stands in for the handoff: copies the source engine's pinned blocks into the puller's
    reserved ones, or fails, as each test says."""

    source: LLMEngine
    target: LLMEngine
    mode: str = "copy"  # copy | fail | hold
    pulls: list[Pull] = field(default_factory=list)

    def __call__(self, request_id: str, token_ids: list[int], first_block: int,
                 device_ids: list[int]) -> None:
        pull = Pull(request_id, token_ids, first_block, device_ids)
        self.pulls.append(pull)
        if self.mode == "copy":
            self.copy(pull)
        elif self.mode == "fail":
            self.target.kv_cache[:, :, device_ids] = 7.0  # what a torn copy could leave
            self.finish(pull, "peer_gone")

    def copy(self, pull: Pull) -> None:
        src = self.source.kv_manager.pin_cached("pull", pull.token_ids, pull.first_block)
        assert src is not None and len(src) == len(pull.device_ids)
        assert self.source.kv_stats().tiers.num_peer_pinned_blocks == len(src)
        self.target.kv_cache[:, :, pull.device_ids] = self.source.kv_cache[:, :, src]
        self.source.kv_manager.unpin("pull")
        self.finish(pull, None)

    def finish(self, pull: Pull, error: str | None) -> None:
        nbytes = 0 if error else len(pull.device_ids) * kv_cache_bytes(self.target.layout, 1)
        assert self.target.tiers.peer is not None
        self.target.tiers.peer.finish(pull.request_id, error, nbytes, 0.001)


def engines(loaded: LoadedModel, path: str, mode: str = "copy",
            latency_s: float = 0.0) -> tuple[LLMEngine, LLMEngine, CopyPeer]:
    source = LLMEngine(engine_config(path, num_kv_blocks=64), loaded=loaded)
    target = LLMEngine(engine_config(path, num_kv_blocks=64), loaded=loaded)
    peer = CopyPeer(source, target, mode)
    target.tiers.attach_peer(peer, latency_s, 1e12)
    return source, target, peer


def cached_at_source(source: LLMEngine, target: LLMEngine, prompt: list[int]) -> None:
    """The source caches ``prompt``; the target is told the source holds 7 of its blocks."""
    run(source, {"s": prompt})
    target.tiers.peer.hint("t", 7)  # type: ignore[union-attr]


def doc(seed: int, vocab: int, n: int = 120) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def reference(loaded: LoadedModel, path: str, prompt: list[int]) -> list[int]:
    engine = LLMEngine(engine_config(path, num_kv_blocks=64, enable_prefix_caching=False),
                       loaded=loaded)
    try:
        return engine.generate([prompt], GREEDY)[0]
    finally:
        engine.close()


def test_pulled_prefix_is_used_and_matches_one_engine(loaded: LoadedModel, path: str) -> None:
    source, target, peer = engines(loaded, path)
    prompt = doc(1, loaded.config.vocab_size) + [5, 6, 7]  # 123 tokens: 7 full blocks
    cached_at_source(source, target, prompt)
    tokens, reuse = run(target, {"t": prompt})["t"]
    assert tokens == reference(loaded, path, prompt)
    assert [(p.first_block, len(p.device_ids)) for p in peer.pulls] == [(0, 7)]
    assert reuse.tier == "peer" and reuse.num_loaded_tokens == 7 * 16
    assert reuse.decision is not None and reuse.decision.load
    stats = target.kv_stats()
    assert stats.tiers.num_peer_loads == 1
    assert stats.tiers.num_peer_load_bytes == 7 * kv_cache_bytes(target.layout, 1)
    # The pulled blocks joined the target's prefix cache: a repeat is a device hit.
    again = run(target, {"t2": prompt})["t2"]
    assert again[0] == tokens and again[1].num_device_tokens == 7 * 16
    for engine in (source, target):
        settle(engine)
        assert engine.kv_stats().tiers.num_peer_pinned_blocks == 0


def test_pull_after_a_device_prefix_starts_at_its_end(loaded: LoadedModel, path: str) -> None:
    source, target, peer = engines(loaded, path)
    prompt = doc(2, loaded.config.vocab_size) + [9, 9]
    run(source, {"s": prompt})
    run(target, {"t0": prompt[:48] + [4, 4]})  # the target caches 3 blocks of it
    target.tiers.peer.hint("t", 7)  # type: ignore[union-attr]
    tokens, reuse = run(target, {"t": prompt})["t"]
    assert tokens == reference(loaded, path, prompt)
    assert [(p.first_block, len(p.device_ids)) for p in peer.pulls] == [(3, 4)]
    assert reuse.num_device_tokens == 48 and reuse.num_loaded_tokens == 64


def test_failed_pull_computes_the_prefix_and_frees_every_block(loaded: LoadedModel,
                                                               path: str) -> None:
    source, target, peer = engines(loaded, path, mode="fail")
    prompt = doc(3, loaded.config.vocab_size) + [5]
    cached_at_source(source, target, prompt)
    tokens, reuse = run(target, {"t": prompt})["t"]
    assert tokens == reference(loaded, path, prompt)
    assert len(peer.pulls) == 1 and reuse.failure == "peer_gone"
    assert reuse.num_loaded_tokens == 0 and target.scheduler.loads is not None
    assert target.scheduler.loads.num_failures == {"peer_gone": 1}
    settle(target)


def test_abort_mid_pull_frees_the_blocks_when_the_pull_ends(loaded: LoadedModel,
                                                            path: str) -> None:
    source, target, peer = engines(loaded, path, mode="hold")
    prompt = doc(4, loaded.config.vocab_size) + [5]
    cached_at_source(source, target, prompt)
    target.add_request("t", prompt, GREEDY)
    target.step()
    assert len(peer.pulls) == 1 and target.kv_stats().num_loading == 1
    target.abort("t")
    assert target.kv_stats().num_free_blocks < target.kv_stats().num_blocks  # still written
    peer.copy(peer.pulls[0])
    settle(target)
    assert target.kv_stats().num_loading == 0


def test_cost_model_declines_a_pull_that_loses(loaded: LoadedModel, path: str) -> None:
    source, target, peer = engines(loaded, path, latency_s=100.0)
    vocab = loaded.config.vocab_size
    run(target, {"warm": doc(9, vocab)})  # the target measures its prefill rate
    prompt = doc(5, vocab) + [5]
    cached_at_source(source, target, prompt)
    tokens, reuse = run(target, {"t": prompt})["t"]
    assert tokens == reference(loaded, path, prompt) and peer.pulls == []
    decision = reuse.decision
    assert decision is not None and decision.tier == "peer" and not decision.load
    assert decision.load_s is not None and decision.load_s >= 100.0
    assert decision.compute_s is not None and decision.compute_s < decision.load_s
    assert reuse.num_loaded_tokens == 0


def test_measured_pulls_replace_the_assumed_cost() -> None:
    cost = KVCostModel(False)
    cost.set_prior("peer", 0.5, 1e6)
    assert cost.decide("peer", 16, 1_000_000, 16).load_s == pytest.approx(1.5)
    cost.observe_transfer("peer", 1_000_000, 0.01)
    assert cost.decide("peer", 16, 1_000_000, 16).load_s == pytest.approx(0.01)


def test_source_pins_only_cached_blocks(loaded: LoadedModel, path: str) -> None:
    source = LLMEngine(engine_config(path, num_kv_blocks=64), loaded=loaded)
    prompt = doc(6, loaded.config.vocab_size) + [5]
    run(source, {"s": prompt})
    assert source.kv_manager.pin_cached("x", doc(7, loaded.config.vocab_size), 0) is None
    ids = source.kv_manager.pin_cached("p", prompt[:112], 2)
    assert ids is not None and len(ids) == 5
    source.kv_stats()  # integrity: the pins count as holders
    assert source.kv_manager.num_pinned_for_peers == 5
    source.kv_manager.unpin("p")
    stats = source.kv_stats()
    assert stats.num_free_blocks == stats.num_blocks and source.kv_manager.num_pinned_for_peers == 0
