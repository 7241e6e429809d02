"""A pdserve cluster on namespace hosts (`tests/support/hosts.py`), started as a user with three
machines would: `ray start --head` on h0, `ray start --address` on h1 (prefill) and h2 (decode),
each with its own --node-ip-address, then `pdserve serve CONFIG --address` on h0.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdserve.cluster.frontend import direct_ingress_env
from tests.support.hosts import Host, HostNetwork, namespace_hosts
from tests.support.waiting import wait_for

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
GCS_PORT = 6379  # every host has its own network stack: Ray's default ports cannot collide
HTTP_PORT = 8000
START_TIMEOUT_S = 240.0
# The role each worker host carries, as a Ray custom resource (what the config pins to).
ROLE_RESOURCES = {"h0": "pd_head", "h1": "pd_prefill", "h2": "pd_decode"}


@dataclass
class HostCluster:
    """Ray on every host and pdserve served from h0; ``url`` is the ingress on h0."""

    network: HostNetwork
    env: dict[str, str]
    config_path: Path
    model_path: str

    @property
    def head(self) -> Host:
        return self.network.hosts[0]

    @property
    def url(self) -> str:
        return f"http://{self.head.address}:{HTTP_PORT}"

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def host(self, name: str) -> Host:
        return next(h for h in self.network.hosts if h.name == name)

    def log(self, name: str) -> Path:
        return self.network.root / f"{name}.log"

    def start_ray(self, host: Host) -> None:
        """`ray start` on ``host`` (the head on h0), carrying its role's resource."""
        resources = f'--resources={{"{ROLE_RESOURCES[host.name]}": 4}}'
        common = [str(BIN / "ray"), "start", f"--node-ip-address={host.address}", "--num-cpus=1",
                  "--num-gpus=0", resources, f"--object-store-memory={100 * 1024 * 1024}",
                  "--disable-usage-stats"]
        if host is self.head:
            args = [*common, "--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            args = [*common, f"--address={self.gcs_address}"]
        host.run(args, self.env, timeout_s=START_TIMEOUT_S)

    def serve(self) -> None:
        """`pdserve serve CONFIG --address GCS` on the head, until /health answers 200."""
        self.head.popen([str(BIN / "pdserve"), "serve", str(self.config_path), "--address",
                         self.gcs_address], self.env, log=self.log("serve"), cwd=str(REPO))
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        try:
            wait_for(lambda: self.health()[0] == 200, timeout_s, "pdserve /health on h0",
                     interval_s=0.5)
        except AssertionError as exc:
            log = self.log("serve")
            tail = log.read_text()[-3000:] if log.exists() else "(no log)"
            raise AssertionError(f"{exc}; pdserve serve's output ends:\n{tail}") from None

    def health(self) -> tuple[int | None, str]:
        try:
            r = httpx.get(f"{self.url}/health", timeout=5)
        except httpx.HTTPError as exc:
            return None, str(exc)
        return r.status_code, r.text

    def kv_stats(self) -> dict[str, Any]:
        """Every role's KV block and tier counts, asked through Serve by a driver on h0."""
        done = self.head.run([sys.executable, "-m", "tests.support.kv_stats_probe",
                              self.gcs_address], self.env, timeout_s=90, cwd=str(REPO))
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    def metrics(self) -> str:
        r = httpx.get(f"{self.url}/metrics", timeout=10)
        r.raise_for_status()
        return r.text

    def kv_settled(self) -> bool:
        """Every replica the ingress hears from (its load reports, one a second) holds no KV
        block but cached ones and no request."""
        samples = [line.rsplit(" ", 1) for line in self.metrics().splitlines()
                   if line.startswith(("pdserve:kv_cache_usage_perc{",
                                       "pdserve:num_requests_running{",
                                       "pdserve:num_requests_waiting{"))]
        return bool(samples) and all(float(value) == 0 for _, value in samples)

    def chat(self, prompt: str, max_tokens: int, timeout_s: float = 120.0) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "pdserve_timings": True}
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout_s)


def cluster_config(model_path: str, **sections: Mapping[str, Any]) -> dict[str, Any]:
    """Prefill pinned to h1, decode to h2, the ingress to h0; KV over each host's eth0."""
    config: dict[str, Any] = {
        "model": {"path": model_path, "dtype": "float32"},
        "served_model_name": "tiny",
        "engine": {"block_size": 16, "num_kv_blocks": 512, "max_num_batched_tokens": 512,
                   "max_num_seqs": 16, "device": "cpu"},
        "roles": {
            "prefill": {"replicas": 1,
                        "resources": {"num_cpus": 1, "custom": {"pd_prefill": 1}}},
            "decode": {"replicas": 1, "resources": {"num_cpus": 1, "custom": {"pd_decode": 1}}},
        },
        "router": {"min_disaggregated_prompt_tokens": 16, "request_timeout_s": 60,
                   "custom_resources": {"pd_head": 1}},
        "handoff": {"auth_token_env": "PDSERVE_HANDOFF_TOKEN", "net_devices": "eth0",
                    "timeout_s": 20},
        "http": {"host": "0.0.0.0", "port": HTTP_PORT},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def host_env(network: HostNetwork) -> dict[str, str]:
    """What every process on the hosts runs with: this checkout, the cluster's Ray token and
    handoff token (files in the shared dir, as a cluster file copies them), Serve's
    direct-ingress settings."""
    token_path = network.shared / "ray_auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_USAGE_STATS_ENABLED": "0",
           "PDSERVE_HANDOFF_TOKEN": secrets.token_hex(16), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           **direct_ingress_env(HTTP_PORT)}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    return env


@contextmanager
def host_cluster(model_path: str, config: Mapping[str, Any],
                 hostname: str | None = None) -> Iterator[HostCluster]:
    """Three hosts serving ``config`` (its model at ``model_path``, copied to the shared dir);
    ``hostname`` gives every host the same one (pods of one node)."""
    with namespace_hosts(3, hostname) as network:
        shared_model = network.shared / "model"
        shutil.copytree(model_path, shared_model)  # pytest's tmp is under each host's /tmp
        config_path = network.shared / "pdserve.yaml"
        config_path.write_text(yaml.safe_dump({**config, "model": {
            **config["model"], "path": str(shared_model)}}))
        cluster = HostCluster(network, host_env(network), config_path, str(shared_model))
        started = time.monotonic()
        for host in network.hosts:
            cluster.start_ray(host)
        cluster.serve()
        print(f"three-host cluster up in {time.monotonic() - started:.0f} s")
        yield cluster
