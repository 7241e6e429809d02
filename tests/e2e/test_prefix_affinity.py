"""Two prefill and two decode replicas behind prefix-affinity routers: repeats of a long
prefix land on the replicas that already hold it, so every repeat is a prefix-cache hit on
prefill and sends only the blocks after the prefix to decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_prefill_app(served_apps: ServedApps, tiny_checkpoints: dict[str, str]) -> str:
    from tests.support.ray_serve import app_config

    raw = app_config(tiny_checkpoints["llama"], "disaggregated")
    raw["roles"]["prefill"]["replicas"] = raw["roles"]["decode"]["replicas"] = 2
    raw["roles"]["prefill"]["resources"] = {"num_cpus": 0.5}
    raw["roles"]["decode"]["resources"] = {"num_cpus": 0.5}
    raw["router"]["decode_policy"] = "prefix_affinity"
    with served_apps.deploy("affinity", raw) as url:
        yield url


def handoff_bytes(app_url: str) -> float:
    text = httpx.get(f"{app_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:handoff_bytes_sum"))


def test_repeated_prefixes_stick_to_their_replicas(two_prefill_app: str,
                                                   served_apps: ServedApps) -> None:
    families = {
        f"family {k}": f"Document {k}: " + " ".join(f"clause-{k}-{i}" for i in range(60))
        for k in range(3)
    }
    hits: dict[str, list[int]] = {name: [] for name in families}
    sent: dict[str, list[float]] = {name: [] for name in families}
    for round_ in range(4):
        for name, doc in families.items():
            before = handoff_bytes(two_prefill_app)
            r = httpx.post(f"{two_prefill_app}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "max_tokens": 2, "messages": [
                    {"role": "system", "content": doc},
                    {"role": "user", "content": f"question {round_}"}]})
            assert r.status_code == 200, r.text
            hits[name].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            sent[name].append(handoff_bytes(two_prefill_app) - before)
    for name, cached in hits.items():
        assert cached[0] == 0, name
        # Random placement over two replicas would miss a repeat with probability 1/2 each.
        assert all(c > 100 for c in cached[1:]), (name, cached)
        # Decode holds the document's KV from the first time: only the question is sent.
        assert all(0 < b <= sent[name][0] / 4 for b in sent[name][1:]), (name, sent[name])
    stats = served_apps.kv_stats("affinity")
    assert stats["decode"]["num_running"] == 0
