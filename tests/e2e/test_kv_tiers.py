"""KV tiers served for real: two prefill replicas ranked by the cluster prefix index, a host
tier on every worker, device KV four times smaller than the documents' working set. Repeats
find their prefix where it is (device or host), answers equal one engine's greedy tokens,
disaggregated and colocated; every block of every tier comes back; a killed worker's index
entries go at once."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.support.kv_serving import (
    ask_each_twice,
    host_gb,
    settled,
    tiny_fixtures,
)
from tests.support.metrics import metric_value
from tests.support.processes import replica_pids
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 6
DEVICE_BLOCKS = 48  # 768 tokens per worker
DOC_TOKENS = 300  # 19 blocks: six documents are 114 blocks, over twice two workers' device KV


def tiered(path: str, mode: str) -> dict[str, Any]:
    from tests.support.ray_serve import app_config

    raw = app_config(path, mode)
    raw["engine"] |= {"num_kv_blocks": DEVICE_BLOCKS, "host_kv_cache_gb": host_gb(path, 512)}
    raw["router"] |= {"prefill_policy": "prefix_affinity", "decode_policy": "prefix_affinity"}
    raw["roles"]["decode"]["resources"] = {"num_cpus": 0.5}
    if mode == "disaggregated":
        raw["roles"]["prefill"] = {"replicas": 2, "resources": {"num_cpus": 0.5}}
    return raw


documents, greedy = tiny_fixtures(6, DOC_TOKENS, 7, MAX_TOKENS)


def ingress_index(app: str) -> dict[str, dict[str, dict[str, int]]]:
    from ray import serve

    handle = serve.get_deployment_handle("ingress", app_name=app)
    return handle.prefix_index_stats.remote().result(timeout_s=30)


def test_disaggregated_repeats_reuse_their_prefix_from_device_or_host(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], documents: list[list[int]],
        greedy: Any) -> None:
    with ray_serve.deploy("tiers", tiered(tiny_checkpoints["llama"], "disaggregated")) as url:
        wait_for(lambda: len(ingress_index("tiers").get("prefill", {})) == 2, 60,
                 "the ingress to follow both prefill replicas")
        second = ask_each_twice(url, documents, greedy, MAX_TOKENS)
        for timings in second:
            assert timings["cached"] >= DOC_TOKENS - 16, timings  # the whole document
            assert timings["prefill_tokens_computed"] <= 20, timings
        loaded = [t for t in second if t["kv_loaded_tokens"]]
        assert loaded and all(t["kv_tier"] == "host" and t["kv_load_choice"] == "load"
                              for t in loaded), second
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric_value(metrics, "pdserve:prefix_cache_hits_total", 'tier="host"') > 0
        wait_for(lambda: all(settled(ray_serve, "tiers") for _ in range(4)), 30,
                 "every tier's blocks back to baseline")

        index = ingress_index("tiers")["prefill"]
        assert sum(counts["host"] for counts in index.values()) > 0, index
        victim = replica_pids("tiers", "prefill")[0]
        os.kill(victim, signal.SIGKILL)
        # The heartbeat is the load report period (1 s): the entries go before it ends.
        wait_for(lambda: len(ingress_index("tiers")["prefill"]) == 1, 1.0,
                 "the dead worker's index entries to go", interval_s=0.02)


def test_colocated_repeats_load_from_the_host_tier(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], documents: list[list[int]],
        greedy: Any) -> None:
    with ray_serve.deploy("tiers-colo", tiered(tiny_checkpoints["llama"], "colocated")) as url:
        second = ask_each_twice(url, documents[:4], greedy, MAX_TOKENS)
        assert all(t["cached"] >= DOC_TOKENS - 16 for t in second), second
        assert any(t["kv_tier"] == "host" and t["kv_loaded_tokens"] for t in second), second
        wait_for(lambda: settled(ray_serve, "tiers-colo"), 30, "the tiers to settle")
