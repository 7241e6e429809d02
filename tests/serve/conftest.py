"""A real local Ray with two pdserve apps (disaggregated and colocated) on one Serve HTTP port.

Started once per test session module that asks for it; torn down with the Ray it started.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

HANDOFF_TOKEN = "test-cluster-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def app_config(model_path: str, mode: str, **router: Any) -> dict[str, Any]:
    roles: dict[str, Any] = {"decode": {"replicas": 1, "resources": {"num_cpus": 1}}}
    if mode == "disaggregated":
        roles["prefill"] = {"replicas": 1, "resources": {"num_cpus": 1}}
    return {
        "model": {"path": model_path},
        "served_model_name": "tiny",
        "engine": {"block_size": 16, "num_kv_blocks": 256, "max_num_batched_tokens": 512,
                   "max_num_seqs": 48, "device": "cpu"},
        "mode": mode,
        "roles": roles,
        "router": {"min_disaggregated_prompt_tokens": 16, "max_queued_requests": 64,
                   "request_timeout_s": 120} | router,
        "handoff": {"auth_token": HANDOFF_TOKEN, "timeout_s": 20},
    }


@dataclass(frozen=True)
class ServedApps:
    base_url: str  # http://127.0.0.1:PORT

    def url(self, app: str) -> str:
        return f"{self.base_url}/{app}"

    def kv_stats(self, app: str) -> dict[str, dict[str, int]]:
        from ray import serve

        stats = {}
        for role in ("decode", "prefill"):
            try:
                handle = serve.get_deployment_handle(role, app_name=app)
            except Exception:  # noqa: BLE001 - colocated apps have no prefill role
                continue
            stats[role] = handle.kv_stats.remote().result(timeout_s=30)
        return stats

    def wait_all_free(self, app: str, timeout_s: float = 30.0) -> None:
        """Every block back to free-or-cached and every queue empty, on every role."""
        def settled() -> bool:
            return all(
                s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0
                and s["num_waiting"] == 0 and s["num_awaiting_kv"] == 0 and s["num_prefilled"] == 0
                for s in self.kv_stats(app).values()
            )
        wait_for(settled, timeout_s, f"all KV blocks of {app} to be released")


@pytest.fixture(scope="session")
def served_apps(tiny_checkpoints: dict[str, str]) -> Iterator[ServedApps]:
    import ray
    from ray import serve

    from pdserve.cluster.app import build_from_config
    from pdserve.cluster.config import parse_config

    port = free_port()
    # address="local": always a fresh instance of our own, never a cluster found on the machine.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        path = tiny_checkpoints["llama"]
        # The colocated app admits few requests at once, to exercise admission control.
        for name, mode, limit in (("disagg", "disaggregated", 64), ("colo", "colocated", 4)):
            cfg = parse_config(app_config(path, mode, max_queued_requests=limit),
                               source=f"test app {name}")
            serve.run(build_from_config(cfg), name=name, route_prefix=f"/{name}")
        yield ServedApps(f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()
