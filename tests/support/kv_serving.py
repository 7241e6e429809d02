"""Serving apps with KV tiers in tests: a host tier sized in blocks, a completion with the
server's timings, and whether every tier of every role is back to baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from pdserve.engine.kv.cache import GIB, kv_bytes_per_token
from pdserve.engine.model_config import ModelConfig

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps


def host_gb(path: str, num_blocks: int) -> float:
    """engine.host_kv_cache_gb for ``num_blocks`` float32 blocks of 16 tokens."""
    return num_blocks * 16 * kv_bytes_per_token(ModelConfig.from_checkpoint(path), "float32") / GIB


def complete(url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy completion of token ids with `pdserve_timings`; asserts a 200."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "pdserve_timings": True})
    assert r.status_code == 200, r.text
    return r.json()


def settled(served: ServedApps, app: str) -> bool:
    """Every role's device blocks free or cached, nothing loading, no host block read or
    written, no block pinned for a store put."""
    return all(s["num_free_blocks"] == s["num_blocks"] and s["num_loading"] == 0
               and s["tiers"]["num_host_busy_blocks"] == 0
               and s["tiers"]["num_store_pinned_blocks"] == 0
               for s in served.kv_stats(app).values())
