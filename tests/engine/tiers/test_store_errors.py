"""The store tier's thread under a client that fails in ways the tier does not expect: the
job comes back failed (its blocks return to the engine) and the thread keeps serving.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from pdserve.engine.kv.cache import allocate_kv_cache
from pdserve.engine.tiers.store import StoreDone, StoreKVTier
from tests.handoff.handoff_cases import random_layout
from tests.support.waiting import wait_for

NUM_BLOCKS = 4


class FlakyStore:
    """An in-memory store whose next ``failures`` calls raise an unexpected error."""

    def __init__(self, staging_bytes: int) -> None:
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8)
        self.rows: dict[str, torch.Tensor] = {}
        self.failures = 0

    def _maybe_fail(self) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("shape '[4, 2]' is invalid for input of size 3")

    def put(self, keys: Sequence[str], row_bytes: int) -> list[bool]:
        self._maybe_fail()
        for i, key in enumerate(keys):
            self.rows[key] = self.staging[i * row_bytes:(i + 1) * row_bytes].clone()
        return [True] * len(keys)

    def get(self, keys: Sequence[str], row_bytes: int) -> list[bool]:
        self._maybe_fail()
        for i, key in enumerate(keys):
            if key in self.rows:
                self.staging[i * row_bytes:(i + 1) * row_bytes] = self.rows[key]
        return [key in self.rows for key in keys]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [key in self.rows for key in keys]

    def close(self) -> None:
        pass


def wait_done(tier: StoreKVTier) -> StoreDone:
    done: list[StoreDone] = []
    wait_for(lambda: bool(done.extend(tier.poll()) or done), 30, "the store job to finish")
    return done[0]


def test_an_unexpected_error_fails_the_job_and_the_thread_goes_on() -> None:
    layout = random_layout(random.Random(3), "float32")
    cache = allocate_kv_cache(layout, NUM_BLOCKS, "cpu")
    cache.normal_(generator=torch.Generator().manual_seed(1))
    written = cache.clone()
    client = FlakyStore(64 * layout.num_local_layers * layout.block_bytes)
    tier = StoreKVTier(layout, cache, client)
    hashes = [bytes([k]) * 16 for k in range(NUM_BLOCKS)]
    try:
        for put in (True, False):  # a put, then a get, each failing once
            client.failures = 1
            job = tier.submit(put, range(NUM_BLOCKS), hashes)
            failed = wait_done(tier)
            assert failed.job == job and not any(failed.ok)
            assert failed.error == ("store_put" if put else "store_get")
        tier.submit(True, range(NUM_BLOCKS), hashes)
        assert all(wait_done(tier).ok)
        cache.zero_()
        tier.submit(False, range(NUM_BLOCKS), hashes)
        assert all(wait_done(tier).ok)
        assert torch.equal(cache, written)
    finally:
        tier.close()
