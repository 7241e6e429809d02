"""A worker that puts documents into a Mooncake Store until it is killed (the kill -9
mid-put test runs it as a child process): args CHECKPOINT RPC_ADDRESS METADATA READY_FILE."""

from __future__ import annotations

import random
import sys
from pathlib import Path

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.support.kv_tiers import store_client


def main() -> None:
    path, rpc, metadata, ready = sys.argv[1:5]
    engine = LLMEngine(engine_config(path, num_kv_blocks=64))
    engine.tiers.attach_store(store_client(rpc, metadata))
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seed = 0
    while True:
        rng = random.Random(100 + seed % 4)
        engine.generate([[rng.randrange(3, vocab) for _ in range(150)] + [seed]], params)
        engine.step()  # start the puts of what was just released
        if engine.kv_stats().tiers.num_store_puts:
            Path(ready).touch()
        seed += 1


if __name__ == "__main__":
    main()
