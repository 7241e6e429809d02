"""Colocated mode across hosts: the ingress and the KV store's master on h0, one worker on h2
that prefills and decodes. Its tokens reach the ingress over h2's link (the token plane), its
released blocks go into the store, and the answers are one engine's; the prefill host h1
carries no role and sees none of it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multinode.greedy import PROMPTS, reference_texts
from tests.support.host_cluster import HostCluster, cluster_config, host_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.multinode]

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints: dict[str, str]) -> Iterator[HostCluster]:
    path = tiny_checkpoints["llama"]
    config = cluster_config(path)
    config["mode"] = "colocated"
    del config["roles"]["prefill"]
    # The shared KV tier: `pdserve serve` starts its master on h0, the worker's client on h2.
    config["kv_store"] = {"enabled": True, "segment_mb": 32, "staging_mb": 8}
    with host_cluster(path, config) as running:
        yield running


def test_colocated_answers_cross_from_the_worker_host_to_the_ingress(
        cluster: HostCluster, tiny_checkpoints: dict[str, str]) -> None:
    expected = reference_texts(tiny_checkpoints["llama"], MAX_TOKENS)
    worker_sent = cluster.host("h2").link_bytes()[1]
    idle_before = sum(cluster.host("h1").link_bytes())
    for prompt, text in zip(PROMPTS, expected, strict=True):
        r = cluster.chat(prompt, MAX_TOKENS)
        assert r.status_code == 200, r.text
        [timings] = r.json()["pdserve_timings"]
        assert timings["path"] == "colocated" and timings["handoff_bytes"] is None, timings
        assert r.json()["choices"][0]["message"]["content"] == text
    # The answers' text left h2 over its link (frames carry ids and text of every token).
    assert cluster.host("h2").link_bytes()[1] - worker_sent > sum(map(len, expected))
    # h1 only exchanges Ray's heartbeats meanwhile: far less than one request's traffic.
    assert sum(cluster.host("h1").link_bytes()) - idle_before < 200_000
    # The worker on h2 put the blocks its requests released into the store whose master
    # runs on h0.
    stats = cluster.kv_stats()
    assert "tiers" in stats["decode"], stats
    tiers = stats["decode"]["tiers"]
    assert tiers["num_store_puts"] > 0 and tiers["num_store_put_failures"] == 0, tiers
