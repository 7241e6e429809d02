"""Cross-worker prefix reuse served for real: two prefill replicas taking requests in turn
(router.prefill_policy round_robin), so a repeat lands on the replica that did not compute
its prompt. It pulls the prefix from the other one over the UCXX handoff and computes only
the rest, with one engine's greedy tokens; a pull whose estimate loses is declined and
logged; a source killed while the pull waits on it leaves the request computed, correct, and
counted by reason; every block of every worker comes back, pins included."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.support.kv_serving import timings_with_cached, tiny_fixtures
from tests.support.metrics import metric_value
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MAX_TOKENS = 6
DOC_TOKENS = 300  # 18 full blocks, plus the question's
DOC_BLOCKS = DOC_TOKENS // 16


def peer_app(path: str, latency_ms: float) -> dict[str, Any]:
    from tests.support.ray_serve import app_config

    raw = app_config(path, "disaggregated", prefill_policy="round_robin")
    raw["engine"] |= {"num_kv_blocks": 96, "peer_kv_pull": True,
                      "peer_link_latency_ms": latency_ms, "peer_link_gb_per_s": 1000.0}
    raw["roles"]["decode"]["resources"] = {"num_cpus": 0.5}
    raw["roles"]["prefill"] = {"replicas": 2, "resources": {"num_cpus": 0.5}}
    return raw


documents, greedy = tiny_fixtures(4, DOC_TOKENS, 11, MAX_TOKENS)


def complete(url: str, ids: list[int], greedy: Any) -> dict[str, Any]:
    """One request, its text checked against one engine; its timings and cached tokens."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "pdserve_timings": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == greedy(ids)
    return timings_with_cached(body)


def ingress_index(app: str) -> dict[str, dict[str, int]]:
    from ray import serve

    handle = serve.get_deployment_handle("ingress", app_name=app)
    return handle.prefix_index_stats.remote().result(timeout_s=30).get("prefill", {})


def indexed(app: str, num_blocks: int) -> bool:
    """Some prefill replica's device blocks, as the ingress's index has them, reach this."""
    return any(c["device"] >= num_blocks for c in ingress_index(app).values())


def settled(served: ServedApps, app: str) -> bool:
    stats = served.kv_stats(app)
    return all(s["num_free_blocks"] == s["num_blocks"] and s["num_loading"] == 0
               and s["num_prefilled"] == 0 and s["tiers"]["num_peer_pinned_blocks"] == 0
               for s in stats.values())


def test_a_repeat_on_the_other_replica_pulls_the_prefix(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], documents: list[list[int]],
        greedy: Any) -> None:
    with ray_serve.deploy("peer", peer_app(tiny_checkpoints["llama"], 0.0)) as url:
        wait_for(lambda: len(ingress_index("peer")) == 2, 60, "the ingress to follow both")
        ids = documents[0] + [5, 6, 7]
        first = complete(url, ids, greedy)
        assert first["kv_loaded_tokens"] == 0 and first["cached"] == 0, first
        wait_for(lambda: indexed("peer", DOC_BLOCKS), 10, "the index to hold the document")
        again = complete(url, ids, greedy)
        assert again["kv_tier"] == "peer" and again["kv_load_choice"] == "load", again
        assert again["kv_loaded_tokens"] == DOC_BLOCKS * 16, again
        assert again["cached"] == DOC_BLOCKS * 16, again
        assert again["prefill_tokens_computed"] == len(ids) - DOC_BLOCKS * 16, again
        assert again["kv_load_bytes"] > 0 and again["kv_load_failure"] is None, again
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric_value(metrics, "pdserve:prefix_cache_hits_total",
                            'tier="peer"') == DOC_BLOCKS * 16
        assert metric_value(metrics, "pdserve:kv_load_decisions_total",
                            'choice="load",tier="peer"') == 1
        wait_for(lambda: all(settled(ray_serve, "peer") for _ in range(4)), 30,
                 "every worker's blocks and pins back to baseline")


def test_a_pull_that_costs_more_than_computing_is_declined(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], documents: list[list[int]],
        greedy: Any) -> None:
    with ray_serve.deploy("peer-slow", peer_app(tiny_checkpoints["llama"], 60_000.0)) as url:
        wait_for(lambda: len(ingress_index("peer-slow")) == 2, 60, "the ingress to follow both")
        for k in (1, 2):  # one each: both replicas measure their prefill rate
            complete(url, documents[k][:200] + [4], greedy)
        ids = documents[3] + [5, 6, 7]
        complete(url, ids, greedy)
        wait_for(lambda: indexed("peer-slow", DOC_BLOCKS), 10, "the index to hold it")
        again = complete(url, ids, greedy)
        assert again["kv_tier"] == "peer" and again["kv_load_choice"] == "recompute", again
        assert again["kv_load_estimate_ms"] >= 60_000.0, again
        assert again["kv_compute_estimate_ms"] < again["kv_load_estimate_ms"], again
        assert again["kv_loaded_tokens"] == 0 and again["cached"] == 0, again
        assert again["prefill_tokens_computed"] == len(ids), again
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric_value(metrics, "pdserve:kv_load_decisions_total",
                            'choice="recompute",tier="peer"') == 1
        wait_for(lambda: all(settled(ray_serve, "peer-slow") for _ in range(4)), 30,
                 "every worker's blocks back to baseline")


def replica_pid(app: str, replica_id: str) -> int:
    """The process of one Serve replica (its actor is named after the replica's id), from
    the GCS's actor table (the session's Ray runs no dashboard for `ray.util.state`)."""
    from ray._private.state import actors

    found = [a for a in actors(actor_state_name="ALIVE").values()
             if a["Name"] == f"SERVE_REPLICA::{app}#prefill#{replica_id}"]
    assert len(found) == 1, [a["Name"] for a in actors(actor_state_name="ALIVE").values()]
    return int(found[0]["Pid"])


def loading_on_prefill(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return metric_value(metrics, "pdserve:num_requests_loading_kv", 'role="prefill"')


def test_killing_the_source_mid_pull_computes_the_prefix(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], documents: list[list[int]],
        greedy: Any) -> None:
    with ray_serve.deploy("peer-kill", peer_app(tiny_checkpoints["llama"], 0.0)) as url:
        wait_for(lambda: len(ingress_index("peer-kill")) == 2, 60, "the ingress to follow both")
        ids = documents[1] + [8, 9]
        complete(url, ids, greedy)
        wait_for(lambda: indexed("peer-kill", DOC_BLOCKS), 10, "the index to hold it")
        [source] = [rid for rid, c in ingress_index("peer-kill").items()
                    if c["device"] >= DOC_BLOCKS]
        pid = replica_pid("peer-kill", source)
        # Frozen, the source never answers: the other replica waits with its blocks
        # reserved and its ticket out until the source dies.
        os.kill(pid, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, url, ids, greedy)
            wait_for(lambda: loading_on_prefill(url) >= 1, 30, "the pull to be under way")
            os.kill(pid, signal.SIGKILL)
            again = answer.result(timeout=120)
        assert again["kv_tier"] == "peer" and again["kv_load_choice"] == "load", again
        assert again["kv_loaded_tokens"] == 0, again
        assert again["kv_load_failure"] == "peer_gone", again
        assert again["prefill_tokens_computed"] == len(ids), again
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric_value(metrics, "pdserve:kv_load_failures_total",
                            f'reason="{again["kv_load_failure"]}",tier="peer"') == 1
        wait_for(lambda: all(settled(ray_serve, "peer-kill") for _ in range(4)), 60,
                 "the surviving workers' blocks back to baseline")
