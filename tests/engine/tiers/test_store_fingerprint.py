"""The shared store finds a block only for a worker of the same KV layout: the same
checkpoint at another dtype, or at another TP layout (size or rank), never reads blocks
another layout put, and answers as one engine of its own layout would; a TP rank's blocks
go through the store and come back byte for byte to a worker of that same rank."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.cache import allocate_kv_cache, kv_layout_for
from pdserve.engine.kv.layout import KVLayout
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.sampling_params import SamplingParams
from tests.support.kv_tiers import run, settle, store_client
from tests.support.waiting import wait_for

pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed "
                    "(pip install mooncake-transfer-engine-non-cuda)")

from pdserve.cluster.kv_store_master import StoreMaster, start_master, stop_master  # noqa: E402
from pdserve.engine.tiers.mooncake import MooncakeBlockStore  # noqa: E402
from pdserve.engine.tiers.store import StoreDone, StoreKVTier  # noqa: E402

pytestmark = [pytest.mark.slow]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 8


@pytest.fixture
def master(tmp_path: Path) -> Iterator[StoreMaster]:
    started = start_master(log_path=tmp_path / "master.log")
    yield started
    stop_master(started)


def client(master: StoreMaster) -> MooncakeBlockStore:
    return store_client(master.rpc_address, master.metadata_server)


def store_engine(path: str, master: StoreMaster, dtype: str) -> LLMEngine:
    engine = LLMEngine(engine_config(path, dtype=dtype, num_kv_blocks=64))
    engine.tiers.attach_store(client(master))
    return engine


def puts_done(engine: LLMEngine) -> bool:
    settle(engine)
    return engine.kv_stats().tiers.num_store_puts > 0


def test_the_same_checkpoint_at_another_dtype_never_reads_the_blocks(
        tiny_checkpoints: dict[str, str], master: StoreMaster) -> None:
    path = tiny_checkpoints["llama"]
    writer = store_engine(path, master, "float32")
    vocab = writer.loaded.config.vocab_size
    rng = random.Random(3)
    prompt = [rng.randrange(3, vocab) for _ in range(150)] + [5, 6]
    run(writer, {"w": prompt})
    wait_for(lambda: puts_done(writer), 20, "the writer's puts")
    twin = store_engine(path, master, "float32")
    other = store_engine(path, master, "bfloat16")
    tokens, reuse = run(other, {"o": prompt})["o"]
    reference = LLMEngine(engine_config(path, dtype="bfloat16", num_kv_blocks=64,
                                        enable_prefix_caching=False))
    assert tokens == reference.generate([prompt], GREEDY)[0]
    assert reuse.decision is None and reuse.num_loaded_tokens == 0, reuse
    assert other.kv_stats().tiers.num_store_loads == 0
    # The same blocks are there for a worker of the writer's layout.
    _, twin_reuse = run(twin, {"t": prompt})["t"]
    assert twin_reuse.tier == "store" and twin_reuse.num_loaded_tokens == 144, twin_reuse
    assert other.layout.fingerprint != twin.layout.fingerprint == writer.layout.fingerprint
    for engine in (writer, twin, other):
        settle(engine)
        engine.close()
    reference.close()


def wait_done(tier: StoreKVTier) -> StoreDone:
    done: list[StoreDone] = []
    wait_for(lambda: bool(done.extend(tier.poll()) or done), 20, "the store job")
    return done[0]


def tier_of(layout: KVLayout, master: StoreMaster) -> StoreKVTier:
    return StoreKVTier(layout, allocate_kv_cache(layout, NUM_BLOCKS, "cpu"), client(master))


def test_another_tp_layout_never_reads_the_blocks_and_a_rank_reads_its_own(
        tiny_checkpoints: dict[str, str], master: StoreMaster) -> None:
    path = tiny_checkpoints["llama"]
    loaded = LoadedModel.load(path, torch.float32, torch.device("cpu"))
    config, fingerprint = loaded.config, loaded.fingerprint
    assert config.num_kv_heads % 2 == 0, "the tiny model's KV heads split across 2 ranks"

    def layout(rank: int, size: int) -> KVLayout:
        return kv_layout_for(config, fingerprint, torch.float32, 16, rank, size)

    hashes = [bytes([k]) * 16 for k in range(NUM_BLOCKS)]
    written: dict[tuple[int, int], torch.Tensor] = {}
    tiers = []
    for rank, size in ((0, 1), (0, 2)):
        writer = tier_of(layout(rank, size), master)
        writer.device_cache.normal_(generator=torch.Generator().manual_seed(rank + size))
        writer.submit(True, range(NUM_BLOCKS), hashes)
        assert all(wait_done(writer).ok)
        written[(rank, size)] = writer.device_cache.clone()
        tiers.append(writer)
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        reader = tier_of(layout(rank, size), master)
        tiers.append(reader)
        found = reader.continuation(hashes)
        reader.submit(False, range(NUM_BLOCKS), hashes)
        done = wait_done(reader)
        if (rank, size) in written:  # a worker of the writer's layout: every block, exact
            assert found == NUM_BLOCKS and all(done.ok), (rank, size, done)
            assert torch.equal(reader.device_cache, written[(rank, size)]), (rank, size)
        else:  # rank 1 of 2: another layout, nothing found, nothing written into its cache
            assert found == 0 and not any(done.ok), (rank, size, done)
            assert not reader.device_cache.any()
    assert len({t.layout.fingerprint for t in tiers}) == 3
    for tier in tiers:
        tier.close()
