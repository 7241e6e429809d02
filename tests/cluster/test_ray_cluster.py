"""pdserve on a real two-node Ray cluster on this machine, deployed with `serve deploy`.

The head (`ray start --head`) carries the custom resource pd_prefill; a second `ray start
--address` node carries pd_decode and the label pdserve-role=decode. One module-scoped cluster
serves both tests: a chat request that crosses the nodes with a KV handoff, and decode
autoscaling under a burst while the prefill:decode band holds.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdserve.cluster.capacity import RatioBand, check_ratio_band, parse_ratio
from pdserve.cluster.config import parse_config
from pdserve.cluster.frontend import direct_ingress_env, free_http_port
from pdserve.cluster.serve_config import serve_deploy_config
from tests.cluster.local_ray import LocalRayCluster, start_head
from tests.support.metrics import metric_value
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "pd"
MAX_TOKENS = 12
BURST_TOKENS = 200  # long enough to hold the load past look_back + upscale delay
LONG_PROMPT = ("Summarise the shipping rules for every region, then list the exceptions for "
               "fragile parcels and the refund steps. ") * 3


@dataclass(frozen=True)
class Cluster:
    ray: LocalRayCluster
    http_port: int
    model_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def deploy(self, data: dict[str, Any], tmp_path: Path) -> None:
        """Write the pdserve config as a Serve config file and `serve deploy` it."""
        data = {**data, "http": {"host": "127.0.0.1", "port": self.http_port}}
        serve_file = serve_deploy_config(data, parse_config(data), APP, "HeadOnly")
        path = tmp_path / "serve.yaml"
        path.write_text(yaml.safe_dump(serve_file))
        previous = self._app().get("last_deployed_time_s")
        self.ray.serve_deploy(path)

        def running() -> bool:
            # A redeploy replaces the ingress replica: the app still reads RUNNING from the
            # previous config until the controller takes the new one, and the old replica's
            # port refuses connections once it stops. Wait for this deploy, every replica
            # running, and the ingress answering.
            app = self._app()
            if app.get("status") == "DEPLOY_FAILED":
                raise AssertionError(f"deploy failed: {app['message']}")
            if app.get("status") != "RUNNING" or app.get("last_deployed_time_s") == previous:
                return False
            if not all(r["state"] == "RUNNING" and len(d["replicas"]) == d["target_num_replicas"]
                       for d in app["deployments"].values() for r in d["replicas"]):
                return False
            try:
                return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(running, 120, f"Serve app {APP} to run", interval_s=0.5)

    def _app(self) -> dict[str, Any]:
        return dict(self.ray.serve_details().get("applications", {}).get(APP) or {})

    def deployments(self) -> dict[str, Any]:
        return dict(self.ray.serve_details()["applications"][APP]["deployments"])


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints: dict[str, str]) -> Iterator[Cluster]:
    # Every node runs Serve as the cluster files start it: the ingress serves http.port.
    http_port = free_http_port()
    ray = start_head(num_cpus=2, resources={"pd_prefill": 4},
                     extra_env=direct_ingress_env(http_port))
    try:
        ray.add_node(num_cpus=2, resources={"pd_decode": 4}, labels={"pdserve-role": "decode"})
        yield Cluster(ray, http_port, tiny_checkpoints["llama"])
    finally:
        ray.stop()


def base_config(model_path: str) -> dict[str, Any]:
    return {
        "model": {"path": model_path},
        "served_model_name": "tiny",
        "engine": {"block_size": 16, "num_kv_blocks": 1024, "max_num_batched_tokens": 512,
                   "max_num_seqs": 32, "device": "cpu"},
        "router": {"min_disaggregated_prompt_tokens": 16, "request_timeout_s": 120},
        "handoff": {"timeout_s": 20},
    }


def reference_text(model_path: str) -> str:
    from pdserve.cluster.config import engine_config
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(model_path, num_kv_blocks=128))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": LONG_PROMPT}])
    [tokens] = engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return engine.tokenizer.decode(tokens)


def test_chat_crosses_nodes_with_a_kv_handoff(cluster: Cluster, tmp_path: Path) -> None:
    data = base_config(cluster.model_path)
    data["roles"] = {
        "prefill": {"replicas": 1, "resources": {"num_cpus": 1, "custom": {"pd_prefill": 1}}},
        "decode": {"replicas": 1, "resources": {"num_cpus": 1, "custom": {"pd_decode": 1}}},
    }
    cluster.deploy(data, tmp_path)
    nodes = httpx.get(f"{cluster.ray.dashboard_url}/api/v0/nodes", timeout=30,
                      headers=cluster.ray.auth_headers).json()["data"]["result"]["result"]
    resources_of = {n["node_id"]: n["resources_total"] for n in nodes if n["state"] == "ALIVE"}
    assert len(resources_of) == 2
    [prefill], [decode] = (cluster.deployments()[r]["replicas"] for r in ("prefill", "decode"))
    assert prefill["node_id"] != decode["node_id"]
    assert "pd_prefill" in resources_of[prefill["node_id"]]
    assert "pd_decode" in resources_of[decode["node_id"]]

    before = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    body = {"model": "tiny", "messages": [{"role": "user", "content": LONG_PROMPT}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["prompt_tokens"] > 16  # above min_disaggregated_prompt_tokens
    assert answer["choices"][0]["message"]["content"] == reference_text(cluster.model_path)
    after = httpx.get(f"{cluster.url}/metrics", timeout=30).text
    handoffs = (metric_value(after, "pdserve:handoff_seconds_count")
                - metric_value(before, "pdserve:handoff_seconds_count"))
    assert handoffs == 1
    assert 'path="disaggregated"' in after


@dataclass(frozen=True)
class Observation:
    prefill_running: int
    decode_running: int
    prefill_target: int
    decode_target: int


class StatusPoller:
    """Polls Serve's status (replica states and targets) in a thread until stopped."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.observations: list[Observation] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StatusPoller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def latest(self) -> Observation:
        return self.observations[-1]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                deployments = self.cluster.deployments()
                running = {name: sum(r["state"] == "RUNNING" for r in d["replicas"])
                           for name, d in deployments.items()}
                self.observations.append(Observation(
                    running["prefill"], running["decode"],
                    deployments["prefill"]["target_num_replicas"],
                    deployments["decode"]["target_num_replicas"]))
            except (httpx.HTTPError, KeyError) as exc:
                self.errors.append(exc)
            self._stop.wait(0.25)


def stream_chat(url: str, question: str, max_tokens: int) -> int:
    """Stream one chat answer to its end; return the completion tokens its usage reports."""
    body = {"model": "tiny", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question}]}
    usage = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
    assert usage is not None
    return int(usage["completion_tokens"])


def test_decode_scales_up_and_down_inside_the_ratio_band(cluster: Cluster,
                                                         tmp_path: Path) -> None:
    data = base_config(cluster.model_path)
    data["roles"] = {
        "prefill": {"replicas": 1,
                    "resources": {"num_cpus": 0.5, "custom": {"pd_prefill": 1}}},
        # Decode is pinned by node label, not by a resource.
        "decode": {"replicas": 1, "resources": {"num_cpus": 0.5},
                   "node_labels": {"pdserve-role": "decode"},
                   "autoscaling": {"min_replicas": 1, "max_replicas": 3,
                                   "target_ongoing_requests": 2, "upscale_delay_s": 1,
                                   "downscale_delay_s": 3, "look_back_period_s": 2,
                                   "metrics_interval_s": 0.5}},
    }
    # Load alone would ask for max_replicas=3 decode replicas; the band allows 2 per prefill.
    data["router"] = {**data["router"], "ratio_band": {"min": "1:2", "max": "1:1"}}
    band = RatioBand.from_ratios(parse_ratio("1:2"), parse_ratio("1:1"))
    cluster.deploy(data, tmp_path)
    with StatusPoller(cluster) as poller:
        wait_for(lambda: bool(poller.observations), 30, "a first status")
        with ThreadPoolExecutor(max_workers=24) as pool:
            burst = [pool.submit(stream_chat, cluster.url, f"Question {i}: why?", BURST_TOKENS)
                     for i in range(24)]
            assert [f.result(timeout=120) for f in burst] == [BURST_TOKENS] * 24
        # The burst asked for the second replica; it runs, then idles out after the delay.
        wait_for(lambda: poller.latest().decode_running == 2, 90,
                 "decode to scale up to 2 running replicas")
        wait_for(lambda: poller.latest().decode_running == 1
                 and poller.latest().decode_target == 1, 60, "decode to scale back down to 1")
    assert not poller.errors, poller.errors[:3]
    observed = poller.observations
    assert max(o.decode_target for o in observed) == 2  # capped by the band, not max_replicas
    for o in observed:
        assert o.prefill_running == o.prefill_target == 1
        assert check_ratio_band(o.prefill_running, o.decode_running, band), o
        assert check_ratio_band(o.prefill_target, o.decode_target, band), o
    # Decode replicas stayed on the labelled node.
    nodes = {r["node_id"] for r in cluster.deployments()["decode"]["replicas"]}
    assert len(nodes) == 1
