"""The shared tier on a real Mooncake Store master: a worker that never saw a document loads
its prefix from the store and answers as one engine would; a checkpoint with another
fingerprint never reads those blocks; a worker killed mid-put leaves nothing wrong behind;
with the master killed, serving goes on without the tier (counted), every answer right."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.sampling_params import SamplingParams
from tests.support.kv_tiers import run, settle, store_client
from tests.support.waiting import wait_for

mooncake = pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not "
                               "installed (pip install mooncake-transfer-engine-non-cuda)")

from pdserve.cluster.kv_store_master import StoreMaster, start_master, stop_master  # noqa: E402

pytestmark = [pytest.mark.slow]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PUTTER = Path(__file__).with_name("store_putter.py")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[StoreMaster]:
    started = start_master(log_path=tmp_path / "master.log")
    yield started
    stop_master(started)


def store_engine(path: str, master: StoreMaster, loaded: LoadedModel | None = None,
                 **engine: object) -> LLMEngine:
    e = LLMEngine(engine_config(path, num_kv_blocks=64, **engine), loaded=loaded)
    e.tiers.attach_store(store_client(master.rpc_address, master.metadata_server))
    return e


def reference(path: str, prompt: list[int]) -> list[int]:
    e = LLMEngine(engine_config(path, num_kv_blocks=128, enable_prefix_caching=False))
    try:
        return e.generate([prompt], GREEDY)[0]
    finally:
        e.close()


def doc(seed: int, vocab: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def puts_done(engine: LLMEngine) -> bool:
    settle(engine)
    return engine.kv_stats().tiers.num_store_puts > 0


def test_a_fresh_worker_loads_a_prefix_another_put(tiny_checkpoints: dict[str, str],
                                                   master: StoreMaster) -> None:
    path = tiny_checkpoints["llama"]
    loaded = LoadedModel.load(path, torch.float32, torch.device("cpu"))
    prompt = doc(1, loaded.config.vocab_size) + [5, 6]
    writer = store_engine(path, master, loaded)
    run(writer, {"w": prompt})
    wait_for(lambda: puts_done(writer), 20, "the writer's puts")
    reader = store_engine(path, master, loaded)
    tokens, reuse = run(reader, {"r": prompt})["r"]
    assert tokens == reference(path, prompt)
    assert reuse.tier == "store" and reuse.num_loaded_tokens == 144, reuse
    other = tiny_checkpoints["qwen2"]  # another checkpoint against the same store
    stranger = store_engine(other, master)
    tokens, reuse = run(stranger, {"s": prompt})["s"]
    assert tokens == reference(other, prompt)
    assert reuse.decision is None and reuse.num_loaded_tokens == 0, reuse
    assert stranger.layout.fingerprint != reader.layout.fingerprint
    for e in (writer, reader, stranger):
        settle(e)
        e.close()


def test_a_worker_killed_mid_put_leaves_nothing_wrong(tiny_checkpoints: dict[str, str],
                                                      master: StoreMaster,
                                                      tmp_path: Path) -> None:
    path = tiny_checkpoints["llama"]
    ready = tmp_path / "putting"
    child = subprocess.Popen([sys.executable, str(PUTTER), path, master.rpc_address,
                              master.metadata_server, str(ready)],
                             env=os.environ | {"PYTHONPATH": os.getcwd()})
    try:
        wait_for(lambda: ready.exists() or child.poll() is not None, 120, "the putter to put")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    reader = store_engine(path, master)
    vocab = reader.loaded.config.vocab_size
    for seed in range(4):  # the documents the putter was putting: each right, loaded or not
        prompt = doc(100 + seed, vocab) + [7]
        tokens, _ = run(reader, {f"r{seed}": prompt})[f"r{seed}"]
        assert tokens == reference(path, prompt)
    settle(reader)
    reader.close()


def test_with_the_master_killed_serving_goes_on_without_the_tier(
        tiny_checkpoints: dict[str, str], master: StoreMaster) -> None:
    path = tiny_checkpoints["llama"]
    engine = store_engine(path, master)
    vocab = engine.loaded.config.vocab_size
    run(engine, {"a": doc(2, vocab) + [1]})
    wait_for(lambda: puts_done(engine), 20, "the puts")
    stop_master(master)
    for seed in range(3):
        prompt = doc(3 + seed, vocab) + [1]
        assert run(engine, {f"b{seed}": prompt})[f"b{seed}"][0] == reference(path, prompt)
    fresh = doc(2, vocab) + [2]
    assert run(engine, {"c": fresh})["c"][0] == reference(path, fresh)
    settle(engine)
    stats = engine.kv_stats().tiers
    assert stats.num_store_unavailable > 0 or stats.num_store_put_failures > 0, stats
    engine.close()
